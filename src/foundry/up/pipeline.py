"""`run_stack`: the pipeline of `foundry up` (see the package docstring), from the plan to a
clean stop."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import secrets
import shutil
import sys
import time
from pathlib import Path
from typing import TextIO

from foundry.model.formats.checkpoint import CheckpointError, load_checkpoint
from foundry.model.formats.checkpoint_dir import list_checkpoints
from foundry.model.formats.gguf_model import GGUF_MAGIC_BYTES
from foundry.model.formats.tuning import TunedConfig
from foundry.model.infer.generate import greedy_text, printable
from foundry.model.text.data import compressor_bits_per_byte, load_corpus, primed_bits_per_byte
from foundry.model.train.training import (
    against_compressors,
    beaten_line,
    bits_per_byte,
    held_out_line,
)
from foundry.up.clients import AdminLink, generate
from foundry.up.plan import (
    StackError,
    StackOptions,
    StackPorts,
    addr,
    gateway_service,
    local_host,
    prometheus_config,
    prometheus_service,
    serving_services,
    training_services,
)
from foundry.up.supervisor import RunDirLock, Stack, StopRequested, check_ports_free
from foundry.up.view import LiveView, TrainingSummary
from foundry.wire import fdtc

# How often the live view asks the coordinator for its status.
POLL_S = 0.5
# The final sample through the gateway: sampled at this temperature and top-p.
SAMPLE_TEMPERATURE = 0.7
SAMPLE_TOP_P = 0.9
# Tokens of each sample shown while training.
TRAINING_SAMPLE_TOKENS = 48


class CheckpointSamples:
    """Greedy samples of the prompt from the coordinator's checkpoints as they appear, so the
    user watches the model learn: drawn here, from the file, costing the swarm nothing."""

    def __init__(self, directory: Path, prompt: str, every: int) -> None:
        self.directory = directory
        self.prompt = prompt
        self.every = every  # a sample from the first checkpoint at or after each multiple
        self._due = every
        self._sampled = 0  # the step of the last sample shown

    def poll(self, last: bool = False) -> str | None:
        """The sample of the oldest kept checkpoint at or after the next multiple (the newest,
        when ``last``: the run's final weights), or None. Polls fall between checkpoints, so it
        looks at every one still on disk: a fast run shows its samples at the multiples, not
        wherever a poll landed."""
        # The final weights need not fall on a multiple: ``last`` takes anything newer.
        first = self._sampled + 1 if last else self._due
        found = [(step, path) for step, path in list_checkpoints(self.directory) if step >= first]
        for _, path in reversed(found) if last else found:
            try:
                state = load_checkpoint(path)
            except (OSError, CheckpointError):
                continue  # rotated away since the listing, or damaged: the next one will do
            self._due = (state.step // self.every + 1) * self.every
            self._sampled = state.step
            if isinstance(state.config, TunedConfig):  # adapters alone: no model to sample
                self._due = 1 << 62
                return None
            text = greedy_text(state.config, state.params, self.prompt, TRAINING_SAMPLE_TOKENS)
            return f"step {state.step}: {printable(self.prompt + text)!r}"
        return None


def foundry_command() -> str:
    """How to run `foundry` from the user's shell: ``foundry`` when that is this one on PATH,
    else the path of this environment's script (a venv not activated)."""
    script = Path(sys.executable).parent / "foundry"
    found = shutil.which("foundry")
    if found is not None and Path(found).resolve() == script.resolve():
        return "foundry"
    return str(script) if script.exists() else "foundry"


def watch_training(
    stack: Stack,
    admin: AdminLink,
    view: LiveView,
    summary: TrainingSummary,
    samples: CheckpointSamples,
) -> fdtc.SwarmStatus:
    t0 = time.monotonic()
    coordinator = stack.child("coordinator")
    while True:
        stack.supervise()
        line = samples.poll()
        if line is not None:
            view.note(line)
        try:
            st, detail = admin.status()
        except StackError:
            # A coordinator that is being restarted cannot answer yet; it resumes from its
            # last checkpoint and the workers find it again by themselves.
            if coordinator is not None and coordinator.settling():
                time.sleep(POLL_S)
                continue
            raise
        summary.polls += 1
        if not math.isnan(st.train_loss):
            if math.isnan(summary.first_loss):
                summary.first_loss = st.train_loss
                summary.first_loss_step = st.global_step
            summary.last_loss = st.train_loss
        summary.val_loss = st.val_loss
        summary.first_val_loss = detail.first_val_loss
        summary.first_val_step = detail.first_val_step
        summary.steps = st.global_step
        view.update(st, detail)
        if st.state is fdtc.SwarmState.DONE:
            summary.seconds = time.monotonic() - t0
            # The last checkpoint is written before DONE: its sample, if the loop missed it.
            line = samples.poll(last=True)
            if line is not None:
                view.note(line)
            return st
        time.sleep(POLL_S)


def check_model_file(path: Path) -> None:
    """Raise StackError unless ``path`` is a readable file that starts as a GGUF file does."""
    try:
        with path.open("rb") as f:
            head = f.read(len(GGUF_MAGIC_BYTES))
    except FileNotFoundError:
        raise StackError(f"--model {path}: no such file") from None
    except OSError as exc:
        raise StackError(f"--model {path}: cannot read it ({exc.strerror})") from None
    if head != GGUF_MAGIC_BYTES:
        raise StackError(
            f"--model {path} is not a GGUF file (it starts with {head!r}); "
            "pass a .gguf model file (docs/models.md)"
        )


def run_stack(opt: StackOptions, out: TextIO = sys.stdout) -> int:
    """`foundry up`: 0 after a clean stop, 1 when the stack could not start or failed."""
    ports = StackPorts.of(opt)
    prometheus = shutil.which("prometheus") if opt.prometheus else None
    if prometheus is None:
        ports = StackPorts.of(dataclasses.replace(opt, prometheus=False))
    run = opt.run_dir
    if opt.model is not None:
        check_model_file(opt.model)  # before the run folder exists: a typo leaves nothing
    try:
        run.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise StackError(f"cannot create --run-dir {run}: {exc.strerror}") from None
    lock = RunDirLock(run)
    lock.acquire()
    try:
        check_ports_free(ports, opt.host)
        return _run_locked(opt, ports, prometheus, out)
    finally:
        lock.release()


def _run_locked(opt: StackOptions, ports: StackPorts, prometheus: str | None, out: TextIO) -> int:
    run = opt.run_dir
    if opt.fresh:
        shutil.rmtree(run / "checkpoints", ignore_errors=True)
    # Where the coordinator resumes: its newest checkpoint, read before it starts (the step
    # of the first status poll depends on how fast the services came up).
    resumes_at = max((step for step, _ in list_checkpoints(run / "checkpoints")), default=0)
    token_file = None
    token = None
    if not opt.loopback:
        # Off loopback the gateway is reachable from the network: require a token.
        token_file = run / "token"
        token = secrets.token_urlsafe(32)
        token_file.unlink(missing_ok=True)
        fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(token + "\n")

    stack = Stack(run, out)
    tty = out.isatty()
    view = LiveView(out, opt.steps, tty, workers=opt.workers, per_token=opt.base_model is not None)
    admin = AdminLink("127.0.0.1", ports.admin)
    t_start = time.monotonic()
    code = 0
    with stack.signals():
        try:
            stack.say(f"foundry up: run dir {run}, logs in {run / 'logs'}")
            if opt.model is not None:
                return _serve_file(opt, ports, stack, token, token_file, t_start, opt.model)
            if opt.base_model is not None:
                return _fine_tune(
                    opt, ports, stack, admin, view, prometheus, token, token_file, t_start
                )
            # The yardstick first (xz primed with the training text takes a few seconds): the
            # live view must be watching from the first step, or the run looks resumed.
            corpus = load_corpus(None)
            held_out = corpus.held_out_bytes(opt.seq_len)
            yardstick = compressor_bits_per_byte(held_out) | primed_bits_per_byte(
                held_out, corpus.training_bytes(opt.seq_len)
            )
            first = [stack.start(s) for s in training_services(opt, ports, token_file)]
            if prometheus is not None:
                (run / "prometheus.yml").write_text(prometheus_config(ports, opt.host))
                first.append(stack.start(prometheus_service(opt, ports, prometheus)))
            stack.wait_ready(first)
            stack.say(
                f"started coordinator {addr(opt.host, ports.coordinator)}, gateway "
                f"{addr(opt.host, ports.gateway)}, {opt.workers} worker(s)"
                + (
                    f", prometheus http://{addr(local_host(opt.host), ports.prometheus or 0)}"
                    if prometheus
                    else ", no prometheus (not installed or --no-prometheus)"
                )
            )
            stack.say(
                f"training {opt.preset} for {opt.steps} steps of {opt.global_batch}x"
                f"{opt.seq_len} on the bundled corpus; a greedy sample every "
                f"{opt.sample_interval} steps"
            )
            stack.say(held_out_line(len(held_out), yardstick))
            if resumes_at:
                stack.say(
                    f"resuming from step {resumes_at} (the newest checkpoint in "
                    f"{run / 'checkpoints'}; --fresh starts at step 0)"
                )
            summary = TrainingSummary(start_step=resumes_at)
            try:
                watch_training(
                    stack,
                    admin,
                    view,
                    summary,
                    CheckpointSamples(run / "checkpoints", opt.prompt, opt.sample_interval),
                )
            finally:
                view.close()
            if summary.polls == 1:
                stack.say(
                    f"training was already done at step {summary.steps} (checkpoints in "
                    f"{run / 'checkpoints'}; --fresh trains again)"
                )
            else:
                stack.say(
                    f"training done at step {summary.steps}: {summary.loss_text()}, "
                    "held-out "
                    + against_compressors(bits_per_byte(summary.val_loss), yardstick)
                    + f" ({summary.seconds:.0f} s)"
                )
                stack.say(beaten_line(bits_per_byte(summary.val_loss), yardstick))
            model = admin.export(_short_path(run / "model.gguf"))
            admin.close()
            stack.say(f"exported {model}")
            pair = [stack.start(s) for s in serving_services(opt, ports, model)]
            stack.wait_ready(pair)
            target = addr("127.0.0.1", ports.gateway)
            # Sampled, not greedy: a small model's greedy text falls into a loop ('and
            # "__getitem__()" and "__getitem__()" and ...'); the same seed gives the same text.
            text = generate(
                target,
                opt.prompt,
                opt.sample_tokens,
                token,
                stack.check_stop,
                temperature=SAMPLE_TEMPERATURE,
                top_p=SAMPLE_TOP_P,
                seed=0,
            )
            stack.say(
                f"sample (temperature {SAMPLE_TEMPERATURE:g}, top-p {SAMPLE_TOP_P:g}, "
                f"seed 0, {opt.sample_tokens} tokens): "
                f"{printable(opt.prompt + text)!r}"
            )
            gateway = addr(local_host(opt.host), ports.gateway)
            ctl = f"{foundry_command()} ctl --gateway {gateway}" + (
                f" --token-file {token_file}" if token_file else ""
            )
            stack.say(
                f"ready in {time.monotonic() - t_start:.0f} s: `{ctl} status`, "
                f"`{ctl} generate --prompt TEXT`, OpenAI-compatible API on "
                f"http://{addr(local_host(opt.host), ports.http)}/v1; Ctrl+C stops everything"
            )
            while True:
                stack.supervise(training=False)
                time.sleep(POLL_S)
        except StopRequested:
            stack.say("stopping (Ctrl+C again to kill at once)")
        except StackError as exc:
            stack.say(f"error: {exc}")
            code = 1
        finally:
            admin.close()
            killed = stack.stop_all()
            stack.say(
                f"stopped {len(stack.children)} processes"
                + (f" ({', '.join(killed)} had to be killed)" if killed else "")
            )
    return code


def _serve_file(
    opt: StackOptions,
    ports: StackPorts,
    stack: Stack,
    token: str | None,
    token_file: Path | None,
    t_start: float,
    model: Path,
) -> int:
    """`foundry up --model FILE`: the gateway and the pair on a published file, no training.
    Runs inside ``_run_locked``'s signal handling; a StopRequested or StackError propagates
    to it."""
    from foundry.model.formats.gguf_io import load_gguf
    from foundry.model.formats.gguf_model import GGUFError

    try:  # refuse a file the pair cannot run before any process starts, in one line
        load_gguf(model, select=lambda name, view: None)
    except GGUFError as exc:
        raise StackError(str(exc)) from None
    first = [stack.start(gateway_service(opt, ports, token_file))]
    first += [stack.start(s) for s in serving_services(opt, ports, model)]
    stack.wait_ready(first)
    stack.say(
        f"serving {model} on the tensor-parallel pair, gateway "
        f"{addr(opt.host, ports.gateway)} (no training)"
    )
    text = generate(
        addr("127.0.0.1", ports.gateway), opt.prompt, opt.sample_tokens, token, stack.check_stop
    )
    stack.say(f"sample (greedy, {opt.sample_tokens} tokens): {printable(opt.prompt + text)!r}")
    ctl = f"{foundry_command()} ctl --gateway {addr(local_host(opt.host), ports.gateway)}" + (
        f" --token-file {token_file}" if token_file else ""
    )
    stack.say(
        f"ready in {time.monotonic() - t_start:.0f} s: `{ctl} generate --prompt TEXT`; "
        "Ctrl+C stops everything"
    )
    while True:
        stack.supervise(training=False)
        time.sleep(POLL_S)


def _fine_tune(
    opt: StackOptions,
    ports: StackPorts,
    stack: Stack,
    admin: AdminLink,
    view: LiveView,
    prometheus: str | None,
    token: str | None,
    token_file: Path | None,
    t_start: float,
) -> int:
    """`foundry up --base-model FILE --data PATH`: the coordinator and workers fine-tune the
    file with LoRA, the coordinator exports the adapter, the pair serves the base with it
    behind the gateway. Runs inside ``_run_locked``'s signal handling."""
    from foundry.model.formats.gguf_io import load_gguf
    from foundry.model.formats.gguf_model import GGUFError

    assert opt.base_model is not None
    try:  # refuse a file the swarm cannot tune before any process starts, in one line
        load_gguf(opt.base_model, select=lambda name, view: None)
    except GGUFError as exc:
        raise StackError(str(exc)) from None
    run = opt.run_dir
    first = [stack.start(s) for s in training_services(opt, ports, token_file)]
    if prometheus is not None:
        (run / "prometheus.yml").write_text(prometheus_config(ports, opt.host))
        first.append(stack.start(prometheus_service(opt, ports, prometheus)))
    stack.wait_ready(first)
    stack.say(
        f"fine-tuning {opt.base_model} on {opt.data} with LoRA r={opt.lora_rank} "
        f"alpha={opt.lora_alpha:g} on {opt.lora_targets}: {opt.steps} steps of "
        f"{opt.global_batch}x{opt.seq_len}, {opt.workers} worker(s); only the adapters "
        "travel"
    )
    summary = TrainingSummary()
    try:
        watch_training(
            stack,
            admin,
            view,
            summary,
            CheckpointSamples(run / "checkpoints", opt.prompt, opt.sample_interval),
        )
    finally:
        view.close()
    stack.say(
        f"training done at step {summary.steps}: {summary.loss_text()} ({summary.seconds:.0f} s)"
    )
    before = f" (step {summary.first_val_step})" if summary.first_val_step else ""
    stack.say(
        f"held-out loss: before{before} {summary.first_val_loss:.4f}, after "
        f"{summary.val_loss:.4f} nats/token (perplexity "
        f"{math.exp(summary.first_val_loss):.2f} -> {math.exp(summary.val_loss):.2f})"
    )
    adapter = admin.export(_short_path(run / "adapter.gguf"))
    admin.close()
    stack.say(f"exported the adapter {adapter}")
    pair = [stack.start(s) for s in serving_services(opt, ports, opt.base_model, adapter)]
    stack.wait_ready(pair)
    text = generate(
        addr("127.0.0.1", ports.gateway), opt.prompt, opt.sample_tokens, token, stack.check_stop
    )
    stack.say(f"sample (greedy, {opt.sample_tokens} tokens): {printable(opt.prompt + text)!r}")
    gateway = addr(local_host(opt.host), ports.gateway)
    ctl = f"{foundry_command()} ctl --gateway {gateway}" + (
        f" --token-file {token_file}" if token_file else ""
    )
    stack.say(
        f"ready in {time.monotonic() - t_start:.0f} s: `{ctl} generate --prompt TEXT`, "
        f"OpenAI-compatible API on http://{addr(local_host(opt.host), ports.http)}/v1; "
        "Ctrl+C stops everything"
    )
    while True:
        stack.supervise(training=False)
        time.sleep(POLL_S)


def _short_path(path: Path) -> Path:
    """The relative or absolute spelling of ``path``, whichever fits the 255-byte FDTC field
    (the coordinator runs in our working directory, so both name the same file)."""
    absolute = path.resolve()
    with contextlib.suppress(ValueError):
        relative = absolute.relative_to(Path.cwd())
        if len(str(relative).encode()) < len(str(absolute).encode()):
            return relative
    return absolute
