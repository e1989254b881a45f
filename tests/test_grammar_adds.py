"""Requests whose grammar compiles off the step loop: built in worker threads, handed over when done, refused
with their message, and dropped when cancelled while compiling."""

import threading
import time

from dspark_serve.actors.grammar_adds import GrammarAdds


def test_grammar_adds_build_off_the_loop_and_cancel():
    gate = threading.Event()

    def build(name):
        if name == "slow":
            gate.wait(10)
        if name == "bad":
            raise ValueError("structured_outputs.regex does not compile: x")
        return f"request {name}"

    adds = GrammarAdds(build)
    for rid in ("slow", "bad", "ok"):
        adds.submit(rid, rid)
    end = time.monotonic() + 10
    got = []
    while len(got) < 2 and time.monotonic() < end:
        got += adds.ready()
    assert sorted(got) == [("bad", None, "structured_outputs.regex does not compile: x"), ("ok", "request ok", None)]
    assert adds.pending and adds.cancel("slow") and not adds.cancel("slow")
    gate.set()
    time.sleep(0.2)
    assert adds.ready() == [] and not adds.pending  # cancelled while compiling: it never comes out
    adds.close()
