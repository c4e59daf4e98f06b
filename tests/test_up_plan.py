"""`foundry up`'s plan, the pure parts: ports, command lines, restart back-off, the Prometheus
configuration, which checkpoints give training samples.
"""

from __future__ import annotations

import io
import os
import re
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from foundry.cli import build_parser
from foundry.model.formats.checkpoint import CheckpointState
from foundry.model.formats.checkpoint_dir import checkpoint_name, save_checkpoint
from foundry.model.nn.transformer import init_params
from foundry.model.spec.config import preset
from foundry.model.train.optim import AdamW
from foundry.up.pipeline import CheckpointSamples
from foundry.up.plan import (
    RESTART_MAX_S,
    ServiceSpec,
    StackError,
    StackOptions,
    StackPorts,
    default_checkpoint_every,
    gives_up,
    prometheus_config,
    restart_delay,
    serving_services,
    training_services,
)
from foundry.up.supervisor import PORT_FLAGS, Stack, check_ports_free


def test_default_ports_meet_the_other_commands_defaults() -> None:
    ports = StackPorts.of(StackOptions())
    # foundry worker --coordinator, foundry ctl --gateway, tp-worker --leader defaults.
    assert (ports.coordinator, ports.gateway, ports.tp_leader) == (7070, 50051, 7090)
    assert (ports.admin, ports.tp_frontend) == (7071, 7091)
    # The metrics port plan of services/prometheus/prometheus.yml.
    assert (
        ports.coordinator_metrics,
        ports.tp_leader_metrics,
        ports.gateway_metrics,
        ports.tp_worker_metrics,
    ) == (9100, 9102, 9103, 9104)
    assert ports.worker_metrics == (9110, 9111)
    assert ports.prometheus == 9090


def test_every_port_is_distinct_and_checked() -> None:
    ports = StackPorts.of(StackOptions(workers=5, prometheus=False))
    numbers = [p for _, p in ports.named()]
    assert len(numbers) == len(set(numbers)) == 10 + 5


def test_a_taken_port_is_named_before_anything_starts() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = s.getsockname()[1]
        ports = StackPorts.of(StackOptions(gateway_port=taken, prometheus=False))
        with pytest.raises(StackError, match=rf"port {taken} \(gateway\).*is taken"):
            check_ports_free(ports, "127.0.0.1")


def test_a_taken_port_names_the_flag_that_moves_it() -> None:
    """8080 is the likeliest port to be taken: the error names --http-port for it, and every
    port flag of `foundry up` (each one a flag its --help lists)."""

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = s.getsockname()[1]
        ports = StackPorts.of(StackOptions(http_port=taken, prometheus=False))
        with pytest.raises(StackError) as caught:
            check_ports_free(ports, "127.0.0.1")
    text = str(caught.value)
    assert f"port {taken} (gateway http)" in text and "move it with --http-port" in text
    help_text = subprocess.run(
        [sys.executable, "-m", "foundry", "up", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    flags = set(re.findall(r"--[a-z-]+-port\b", help_text))
    assert flags == set(PORT_FLAGS)
    for flag in PORT_FLAGS:
        assert flag in text


def test_overlapping_bases_are_refused() -> None:
    ports = StackPorts.of(StackOptions(base_port=9080))  # TP leader 9100 = coordinator metrics
    with pytest.raises(StackError, match="port 9100 is both"):
        check_ports_free(ports, "127.0.0.1")


def test_bad_options_are_refused() -> None:
    with pytest.raises(StackError, match="--steps"):
        StackOptions(steps=0)
    with pytest.raises(StackError, match="--workers"):
        StackOptions(workers=0)


def test_command_lines_wire_the_services_together(tmp_path: Path) -> None:
    opt = StackOptions(steps=12, workers=2, run_dir=tmp_path)
    ports = StackPorts.of(opt)
    coordinator, gateway, *workers = training_services(opt, ports, None)
    assert "--max-steps" in coordinator.argv and "12" in coordinator.argv
    assert coordinator.argv[coordinator.argv.index("--min-workers") + 1] == "2"
    assert "--token-file" not in gateway.argv
    assert gateway.argv[gateway.argv.index("--coordinator-admin") + 1] == "127.0.0.1:7071"
    assert gateway.argv[gateway.argv.index("--tp-frontend") + 1] == "127.0.0.1:7091"
    assert [w.name for w in workers] == ["worker-0", "worker-1"]
    assert not any(w.critical for w in workers)
    leader, rank1 = serving_services(opt, ports, tmp_path / "m.gguf")
    assert leader.argv[leader.argv.index("--frontend-listen") + 1] == "127.0.0.1:7091"
    assert rank1.argv[rank1.argv.index("--leader") + 1] == "127.0.0.1:7090"
    token_gateway = training_services(opt, ports, tmp_path / "token")[1]
    assert "--token-file" in token_gateway.argv


def test_keep_quantized_reaches_every_process_holding_the_base_and_needs_one(
    tmp_path: Path,
) -> None:
    base, data = tmp_path / "base.gguf", tmp_path / "text.txt"
    opt = StackOptions(workers=3, run_dir=tmp_path, base_model=base, data=data, keep_quantized=True)
    coordinator, _, *workers = training_services(opt, StackPorts.of(opt), None)
    # the coordinator holds the base too (it validates on it)
    assert all("--keep-quantized" in p.argv for p in (coordinator, *workers))
    for p in (coordinator, workers[0]):  # the commands' own parsers take the lines
        assert build_parser().parse_args(list(p.argv[3:])).keep_quantized is True
    plain = StackOptions(workers=3, run_dir=tmp_path, base_model=base, data=data)
    assert not any(
        "--keep-quantized" in w.argv
        for w in training_services(plain, StackPorts.of(plain), None)[2:]
    )
    with pytest.raises(StackError, match=r"--keep-quantized .* needs --base-model"):
        StackOptions(keep_quantized=True)


def test_checkpoint_interval_is_a_flag_with_a_bounded_default(tmp_path: Path) -> None:
    # A quarter of the run, but never fewer than 10 nor more than 100 steps apart.
    assert [default_checkpoint_every(n) for n in (8, 200, 20000)] == [10, 50, 100]
    opt = StackOptions(steps=20000, checkpoint_every=7, run_dir=tmp_path)
    coordinator = training_services(opt, StackPorts.of(opt), None)[0]
    assert coordinator.argv[coordinator.argv.index("--checkpoint-every") + 1] == "7"
    with pytest.raises(StackError, match="--checkpoint-every"):
        StackOptions(checkpoint_every=0)


def test_restart_backoff_doubles_up_to_a_cap() -> None:
    assert [restart_delay(n) for n in (1, 2, 3)] == [1.0, 2.0, 4.0]
    assert restart_delay(50) == RESTART_MAX_S


def test_five_failures_within_a_minute_leave_a_service_down() -> None:
    assert not gives_up([0.0, 1.0, 3.0, 7.0], 7.5)
    assert gives_up([0.0, 1.0, 3.0, 7.0, 15.0], 15.5)
    # The first of five fell out of the minute: restarted again.
    assert not gives_up([0.0, 30.0, 40.0, 50.0, 60.0], 60.5)


def test_the_command_by_hand_carries_the_stacks_environment_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FOUNDRY_TLS_CERT", "/etc/cert.pem")
    monkeypatch.delenv("OPENBLAS_NUM_THREADS", raising=False)
    monkeypatch.delenv("PYTHONUNBUFFERED", raising=False)
    stack = Stack(tmp_path / "run dir", io.StringIO())
    spec = ServiceSpec("worker-0", (sys.executable, "-c", "print('a b')"), r"a b")
    child = stack.start(spec)
    try:
        command = stack.by_hand(child)
        assert command.startswith(
            f"cd {shlex.quote(os.getcwd())} && env -u FOUNDRY_TLS_CERT OPENBLAS_NUM_THREADS=1 "
            f"PYTHONUNBUFFERED=1 {shlex.quote(sys.executable)} -c "
        ), command
        assert command.endswith(f" >> {shlex.quote(str(child.log))} 2>&1"), command
        child.proc.wait(timeout=30)
        out = subprocess.run(["bash", "-c", command], env=dict(os.environ), timeout=30)
        assert out.returncode == 0
        assert child.log.read_text().count("a b") == 2  # the child's run, then by hand
    finally:
        stack.stop_all(grace_s=1.0)


def test_prometheus_config_scrapes_every_service() -> None:
    text = prometheus_config(StackPorts.of(StackOptions(workers=2)), "0.0.0.0")
    for job in ("coordinator", "worker", "tp-leader", "tp-worker", "gateway"):
        assert f'job_name: "{job}"' in text
    assert '"127.0.0.1:9110", "127.0.0.1:9111"' in text


def test_training_samples_come_from_the_first_kept_checkpoint_past_each_multiple(
    tmp_path: Path,
) -> None:
    cfg = preset("tiny")
    params = init_params(cfg)

    def write(step: int) -> None:
        save_checkpoint(
            tmp_path,
            CheckpointState(
                config=cfg,
                step=step,
                params=params,
                optimizer=AdamW(params).state_dict(),
                data_position=0,
            ),
            keep_last=10,
        )

    samples = CheckpointSamples(tmp_path, "The ", every=3)
    assert samples.poll() is None  # nothing written yet
    for step in (1, 2, 4, 5, 7):  # a poll that falls late sees steps 4 and 7 on disk
        write(step)
    assert (samples.poll() or "").startswith("step 4: 'The ")
    assert (samples.poll() or "").startswith("step 7: 'The ")
    assert samples.poll() is None  # 9 is not written yet
    write(8)
    assert samples.poll() is None
    (tmp_path / checkpoint_name(9)).write_bytes(b"damaged")  # skipped, not fatal
    write(10)
    assert (samples.poll() or "").startswith("step 10: 'The ")
    write(12)
    assert (samples.poll() or "").startswith("step 12: 'The ")
    for step in (13, 14):  # a run that ends at 14, short of the next multiple (15)
        write(step)
    assert samples.poll() is None
    assert (samples.poll(last=True) or "").startswith("step 14: 'The ")  # the final weights
    assert samples.poll(last=True) is None
