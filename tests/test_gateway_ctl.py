"""`foundry ctl` through the gateway and a real pair, down to the check of project issue 6:
`foundry ctl generate` through gateway and pair prints the bytes single-process `foundry
generate` prints. Every piece is a process in that check.
"""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
from pathlib import Path

from gateway_pair import LONG, Pair, free_port, run, running_pair
from gateway_stack import TOKEN, stack
from procs import ENV, Service

GATEWAY_LINE = r"gateway listening: grpc 127\.0\.0\.1:(\d+)"


def _ctl(target: str, token_file: Path | None, *args: str) -> list[str]:
    auth = ["--token-file", str(token_file)] if token_file else []
    return [sys.executable, "-m", "foundry", "ctl", "--gateway", target, *auth, *args]


async def _run(cmd: list[str]) -> tuple[int, str, str]:
    """A command run while this process's event loop (and so an in-process gateway) runs."""
    proc = await asyncio.create_subprocess_exec(
        *cmd, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=ENV
    )
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


def test_ctl_status_shows_the_pair_and_needs_the_token(pair: Pair, tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")

    async def main() -> None:
        async with stack(pair.frontend) as s:
            code, out, err = await _run(_ctl(s.target, token_file, "status"))
            assert code == 1, "the coordinator is down, so status reports a failure"
            assert "pair: worker rank connected" in out, out + err
            # The leader's threads; the plain pair's worker states none (its hello is plain).
            assert re.search(r"rank 0 \(leader\)  share 1/2  threads [1-9]\d*\n", out), out
            assert "rank 1 (worker)  share 1/2  gate wait " in out, out
            assert "training: unavailable" in out and "--admin-listen" in out
            code, out, err = await _run(_ctl(s.target, None, "pause"))
            assert code == 1
            assert "UNAUTHENTICATED" in err and "--token-file" in err

    run(main, timeout_s=60)


def test_ctl_generate_through_gateway_and_pair_prints_what_foundry_generate_prints(
    model: Path, tmp_path: Path
) -> None:
    """Project issue 6: every piece a process, the pair with its default flags (speculative
    decoding on), greedy text compared byte for byte with one process. The model's text is
    varied (random weights: bytes of every kind, invalid UTF-8 included, so the streamed
    pieces must join exactly as the one process joins them); one prompt runs to EOS."""
    with (
        running_pair(model, tmp_path, flags=()) as p,
        Service(
            [
                "gateway",
                "--listen",
                "127.0.0.1:0",
                "--coordinator-admin",
                f"127.0.0.1:{free_port()}",
                "--tp-frontend",
                f"127.0.0.1:{p.frontend}",
            ],
            tmp_path / "gateway.log",
        ) as gateway,
    ):
        target = f"127.0.0.1:{gateway.wait_for(GATEWAY_LINE).group(1)}"
        for prompt, n, finish in [
            ("Hello from the gateway", 80, "max_tokens"),
            ("abc", LONG[1], "eos"),
        ]:
            settings = ["--prompt", prompt, "--max-tokens", str(n), "--temperature", "0"]
            through = subprocess.Popen(
                _ctl(target, None, "generate", *settings, "--stats"),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=ENV,
            )
            one = subprocess.Popen(
                [sys.executable, "-m", "foundry", "generate", "--model", str(model), *settings],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=ENV,
            )
            out, err = through.communicate(timeout=60)
            want, one_err = one.communicate(timeout=60)
            assert through.returncode == 0, err.decode()
            assert one.returncode == 0, one_err.decode()
            assert out == want
            text = out.decode()
            assert text.endswith("\n") and len(set(text)) > 10, text
            assert f"finished: {finish}" in err.decode(), err.decode()
        assert gateway.stop() == 0, gateway.text()
