"""JitWatch through Triton's own hook slots: compiles are counted and timed, chained to a hook already there, and
those outside a warm-up (after the first one) are marked as stalls. The real compiles are counted in
tests/gpu/test_attention_compiles_gpu.py."""

from types import SimpleNamespace

import pytest

knobs = pytest.importorskip("triton").knobs

from dspark_serve.kernels.jit_watch import JitWatch  # noqa: E402


def _compile(name: str) -> None:
    rt = knobs.runtime
    assert not rt.jit_cache_hook(key=name, repr=f"{name}(x: i32)", fn=SimpleNamespace(name=name), compile={},
                                 is_manual_warmup=False, already_compiled=False)
    rt.jit_post_compile_hook(key=name, repr=f"{name}(x: i32)", fn=SimpleNamespace(name=name), compile={},
                             is_manual_warmup=False, already_compiled=False)


def test_counts_marks_stalls_and_chains(monkeypatch):
    seen = []
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", lambda **kw: seen.append(("before", kw["key"])))
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", lambda **kw: seen.append(("after", kw["key"])))
    watch = JitWatch()
    assert watch.install() and watch.install()  # a second install keeps one chain
    _compile("cold")
    with watch.warming():
        _compile("warming")
    _compile("serving")
    with watch.warming():  # another engine's warm-up while this one serves
        _compile("second_engine")
    assert [c.kernel for c in watch.compiles] == ["cold", "warming", "serving", "second_engine"]
    assert [c.after_warm_up for c in watch.compiles] == [False, False, True, False]
    assert watch.count == 4 and watch.after_warm_up == 1 and all(c.ms >= 0 for c in watch.compiles)
    assert seen == [(s, k) for k in ("cold", "warming", "serving", "second_engine") for s in ("before", "after")]
