"""`deepinfer-node serve` driven by the official `openai` Python package (a client nobody here
wrote) on the demo model of configs/local.toml: chat, completion, streaming, log-probabilities
(chat and completions, streamed and not), JSON-schema output,
a tool call, seeded and greedy determinism, streamed == non-streamed text, an invalid request
raising the client's API error with our message, and SIGTERM ending the server with status 0.

Run by .ci/run after `cargo test` (which builds target/debug/deepinfer-node); the binary can be
named with DEEPINFER_NODE. Exits non-zero on the first failed check.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import openai
from openai import OpenAI

ROOT = Path(__file__).resolve().parents[2]
BINARY = Path(os.environ.get("DEEPINFER_NODE", ROOT / "target" / "debug" / "deepinfer-node"))
MODEL = "deepinfer-demo"
# Constraints apply to the answer; the random demo model would never end a reasoning section.
NO_THINKING = {"thinking": {"type": "disabled"}}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port, log):
    if not BINARY.is_file():
        sys.exit(f"missing {BINARY}: build it first (cargo build -p deepinfer-actors)")
    server = subprocess.Popen(
        [str(BINARY), "serve", "--topology", "configs/local.toml", "--listen", f"127.0.0.1:{port}"],
        cwd=ROOT,
        stdout=log,
        stderr=log,
    )
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if server.poll() is not None:
            sys.exit(f"the server exited with {server.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2) as r:
                if r.status == 200:
                    return server
        except OSError:
            time.sleep(0.5)
    server.kill()
    sys.exit("the server was not ready within 600 s")


def check(name, condition, detail=""):
    if not condition:
        raise AssertionError(f"{name}: {detail}")
    print(f"ok  {name}")


def chat(client, **kwargs):
    args = {"model": MODEL, "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 8}
    args.update(kwargs)
    return client.chat.completions.create(**args)


def streamed_chat(client, **kwargs):
    stream = chat(client, stream=True, stream_options={"include_usage": True}, **kwargs)
    text, usage, finish = "", None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    return text, usage, finish


def run_checks(client):
    models = client.models.list()
    check("models lists the served model", [m.id for m in models.data] == [MODEL], models)

    answer = chat(client, seed=11)
    text = answer.choices[0].message.content
    check("chat answers", answer.object == "chat.completion" and text, answer)
    check("chat usage", answer.usage.completion_tokens == 8 and answer.usage.prompt_tokens > 0, answer.usage)
    check("seeded chat twice gives the same text", chat(client, seed=11).choices[0].message.content == text)

    completion = client.completions.create(model=MODEL, prompt="The sea is", max_tokens=8, seed=3)
    check("completion answers", completion.object == "text_completion" and completion.choices[0].text, completion)

    greedy = [
        client.completions.create(model=MODEL, prompt="The sea is", max_tokens=8, temperature=0).choices[0].text
        for _ in range(2)
    ]
    check("temperature 0 twice gives the same text", greedy[0] == greedy[1], greedy)

    streamed, usage, finish = streamed_chat(client, seed=11)
    check("streaming chat with usage", usage is not None and usage.completion_tokens == 8 and finish == "length", usage)
    check("streamed text equals the non-streamed text for the same seed", streamed == text, (streamed, text))

    pieces = [
        c.choices[0].text
        for c in client.completions.create(model=MODEL, prompt="The sea is", max_tokens=8, seed=3, stream=True)
        if c.choices
    ]
    check("streaming completion equals the JSON one", "".join(pieces) == completion.choices[0].text, pieces)

    scored = chat(client, seed=11, logprobs=True, top_logprobs=3)
    entries = scored.choices[0].logprobs.content
    check("chat logprobs: one entry per token, the text unchanged",
          scored.choices[0].message.content == text and len(entries) == scored.usage.completion_tokens, entries)
    check("chat logprobs: top_logprobs most likely first, each a log-probability",
          all(len(e.top_logprobs) == 3 and e.logprob <= 0 and e.bytes is not None
              and [t.logprob for t in e.top_logprobs] == sorted((t.logprob for t in e.top_logprobs), reverse=True)
              and e.logprob <= e.top_logprobs[0].logprob for e in entries), entries)
    streamed_entries = [
        e
        for c in chat(client, seed=11, logprobs=True, top_logprobs=3, stream=True)
        for choice in c.choices if choice.logprobs and choice.logprobs.content
        for e in choice.logprobs.content
    ]
    check("streamed chat logprobs equal the JSON ones",
          [(e.token, e.logprob) for e in streamed_entries] == [(e.token, e.logprob) for e in entries], streamed_entries)
    scored = client.completions.create(model=MODEL, prompt="The sea is", max_tokens=8, seed=3, logprobs=2)
    lp = scored.choices[0].logprobs
    check("completion logprobs: tokens, token_logprobs, top_logprobs, text_offset",
          scored.choices[0].text == completion.choices[0].text and len(lp.tokens) == len(lp.token_logprobs) == scored.usage.completion_tokens
          and all(len(top) <= 2 for top in lp.top_logprobs) and lp.text_offset[0] == 0, lp)
    try:
        chat(client, logprobs=True, top_logprobs=21)
        check("top_logprobs above 20 raises", False, "no error")
    except openai.BadRequestError as error:
        check("top_logprobs above 20 raises naming it", error.status_code == 400 and error.param == "top_logprobs",
              (error.status_code, error.message, error.param))

    schema = {
        "type": "object",
        "properties": {"colour": {"type": "string", "enum": ["red", "green", "blue"]}},
        "required": ["colour"],
        "additionalProperties": False,
    }
    structured = chat(
        client,
        seed=5,
        max_tokens=64,
        extra_body=NO_THINKING,
        response_format={"type": "json_schema", "json_schema": {"name": "colour", "schema": schema, "strict": True}},
    )
    content = structured.choices[0].message.content
    check("JSON-schema output parses and follows the schema", json.loads(content).get("colour") in schema["properties"]["colour"]["enum"], content)

    tools = [{
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                "required": ["city"],
                "additionalProperties": False,
            },
            "strict": True,
        },
    }]
    called = chat(client, seed=5, max_tokens=64, tools=tools, tool_choice="required", extra_body=NO_THINKING,
                  messages=[{"role": "user", "content": "Weather in Paris?"}])
    message = called.choices[0].message
    if message.tool_calls:
        call = message.tool_calls[0]
        ok = call.function.name == "get_weather" and json.loads(call.function.arguments).get("city") in ("Paris", "Rome")
    else:
        # The DSML block the tool-call grammar forces, before responses parse it into tool_calls.
        ok = 'invoke name="get_weather"' in (message.content or "")
    check("a required tool call names the tool", ok, message)

    try:
        client.completions.create(model=MODEL, prompt="x", max_tokens=100_000_000)
        check("an invalid request raises", False, "no error")
    except openai.BadRequestError as error:
        check("an invalid request raises BadRequestError with our message",
              error.status_code == 400 and "`max_tokens` = 100000000 is out of range" in error.message and error.param == "max_tokens",
              (error.status_code, error.message, error.param))


def main():
    port = free_port()
    with tempfile.TemporaryFile(mode="w+") as log:
        server = start_server(port, log)
        try:
            client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=300)
            run_checks(client)
            server.send_signal(signal.SIGTERM)
            code = server.wait(timeout=120)
            check("SIGTERM stops the server with status 0", code == 0, code)
        except BaseException:
            server.kill()
            log.seek(0)
            sys.stderr.write(log.read())
            raise
    print(f"openai {openai.__version__}: every check passed")


if __name__ == "__main__":
    main()
