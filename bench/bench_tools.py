"""Tool calls from the demo pair through `dspark-serve serve --enable-auto-tool-choice --tool-call-parser hermes`:
the official `openai` client's `tools=` with tool_choice auto / required / a named function, streamed and not, and
LangChain's `bind_tools` (invoke and stream). Per mode: requests answered with parsed calls, calls whose arguments
are valid for their function's schema, and greedy streamed calls equal to the unstreamed ones.

usage: python bench/bench_tools.py [--target DIR] [--draft DIR] [--prompts 8] [--device cpu] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import jsonschema

from servers import drain, launch, stop

from dspark_serve.models.demo import DEMO_DRAFTER, demo_target_dir

WEATHER = {"type": "object", "properties": {"city": {"type": "string"},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city"], "additionalProperties": False}
CONVERT = {"type": "object", "properties": {"amount": {"type": "number"}, "from": {"type": "string", "maxLength": 3},
                                            "to": {"type": "string", "maxLength": 3}},
           "required": ["amount", "from", "to"], "additionalProperties": False}
SCHEMAS = {"get_weather": WEATHER, "convert_currency": CONVERT}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "convert_currency",
                                           "description": "Convert an amount between two currencies (ISO codes)",
                                           "parameters": CONVERT}}]
QUESTIONS = ["What's the weather like in Paris right now?", "How many yen is 250 US dollars?",
             "Is it raining in Lima? Answer in fahrenheit.", "Convert 99.5 euros to Swiss francs.",
             "Tell me the current weather in Oslo.", "I have 1200 Canadian dollars; how much is that in pounds?",
             "Weather in Nairobi, please.", "What are 40 Australian dollars in rupees?"]


def start(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "dspark_serve.cluster.commands", "serve", "--target", args.target, "--draft",
           args.draft, "--host", "127.0.0.1", "--port", "0", "--http-port", "0", "--served-model-name", "demo",
           "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--max-model-len", "2048"]
    cmd += ["--device", args.device] if args.device else []
    return launch(cmd, r"serving the OpenAI-compatible HTTP API on (\S+:\d+)", args.start_timeout)


def checked(calls: list[tuple[str, str]]) -> int:
    """How many (name, arguments) calls name a listed function with arguments valid for its schema."""
    ok = 0
    for name, arguments in calls:
        try:
            jsonschema.validate(json.loads(arguments), SCHEMAS[name])
            ok += 1
        except (KeyError, ValueError, jsonschema.ValidationError):
            pass
    return ok


def openai_calls(client, question: str, choice, stream: bool, max_tokens: int) -> list[tuple[str, str]]:
    kw = dict(model="demo", messages=[{"role": "user", "content": question}], tools=TOOLS, tool_choice=choice,
              temperature=0.0, max_tokens=max_tokens)
    if not stream:
        msg = client.chat.completions.create(**kw).choices[0].message
        return [(c.function.name, c.function.arguments) for c in msg.tool_calls or []]
    calls: dict[int, list[str]] = {}
    for chunk in client.chat.completions.create(**kw, stream=True):
        for d in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            entry = calls.setdefault(d.index, ["", ""])
            entry[0] += d.function.name or ""
            entry[1] += d.function.arguments or ""
    return [tuple(calls[i]) for i in sorted(calls)]


def langchain_calls(llm, question: str, choice, stream: bool) -> list[tuple[str, str]]:
    bound = llm.bind_tools(TOOLS, tool_choice=choice)
    if stream:
        msg = None
        for chunk in bound.stream(question):
            msg = chunk if msg is None else msg + chunk
    else:
        msg = bound.invoke(question)
    return [(c["name"], json.dumps(c["args"])) for c in msg.tool_calls]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=str(demo_target_dir()))
    ap.add_argument("--draft", default=str(DEMO_DRAFTER))
    ap.add_argument("--prompts", type=int, default=len(QUESTIONS))
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--device", default=None)
    ap.add_argument("--start-timeout", type=float, default=600.0)
    ap.add_argument("--json")
    args = ap.parse_args()

    import openai
    from langchain_openai import ChatOpenAI

    proc, http = start(args)
    tail = drain(proc)
    questions = QUESTIONS[:args.prompts]
    named = {"type": "function", "function": {"name": "get_weather"}}
    rows = []
    try:
        client = openai.OpenAI(base_url=f"http://{http}/v1", api_key="EMPTY", max_retries=0, timeout=600)
        llm = ChatOpenAI(model="demo", base_url=f"http://{http}/v1", api_key="EMPTY", temperature=0.0,
                         max_tokens=args.max_tokens, max_retries=0, timeout=600)
        modes = [("openai", "auto", "auto"), ("openai", "required", "required"), ("openai", "named", named),
                 ("langchain", "auto", "auto"), ("langchain", "named", "get_weather")]
        for client_name, label, choice in modes:
            t0 = time.perf_counter()
            got = {}
            for stream in (False, True):
                got[stream] = [openai_calls(client, q, choice, stream, args.max_tokens) if client_name == "openai"
                               else langchain_calls(llm, q, choice, stream) for q in questions]
            row = {"client": client_name, "tool_choice": label, "requests": len(questions),
                   "with_calls": sum(bool(c) for c in got[False]),
                   "with_calls_streamed": sum(bool(c) for c in got[True]),
                   "valid_calls": sum(checked(c) for c in got[False]), "calls": sum(len(c) for c in got[False]),
                   "streamed_equal": sum(a == b for a, b in zip(got[False], got[True])),
                   "seconds": round(time.perf_counter() - t0, 1), "examples": got[False][:3]}
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "examples"}), flush=True)
    except Exception:
        print("".join(list(tail)[-30:]), file=sys.stderr)
        raise
    finally:
        stop(proc)
    print("\n| client | tool_choice | requests with calls (streamed) | valid calls / calls | streamed = unstreamed |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['client']} | {r['tool_choice']} | {r['with_calls']} ({r['with_calls_streamed']}) of "
              f"{r['requests']} | {r['valid_calls']} / {r['calls']} | {r['streamed_equal']} of {r['requests']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
