"""Preemption's parts without a job (``cluster.loop.preemption``; issue 37, item 7): the SIGTERM handler (called as
Python calls it), the abortable window and the safe point between steps, the checkpoint they write or leave alone,
the deadline's watchdog (a test clock, the process's end recorded), ``checkpoint.on_preempt`` in the spec, the CLI's
exit code and hint, and checkpoint folders deleted so that nothing half-deleted looks complete. A real signal sent to
a real job is tests/in_process/test_loop_preempt.py."""

from __future__ import annotations

import json
import signal
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from cluster.loop.checkpoints import TRAINER_STATE, complete_checkpoints, latest_checkpoint, remove_checkpoint
from cluster.loop.preemption import PREEMPTED_EXIT_CODE, Preempted, Preemption, StepAborted


class FakeJob:
    """What a :class:`Preemption` asks of a job: its step, its state, and a checkpoint written as the loop does
    (``trainer_state.json`` last)."""

    def __init__(self, root: Path, step: int = 0, fail: bool = False):
        self.root = root
        self.step = step
        self.fail = fail
        self.saved: list[dict] = []

    def checkpoint_state(self) -> dict:
        return {"step": self.step, "sampler": {"offset": 2 * self.step}}

    def save_checkpoint(self, state=None) -> Path:
        state = state if state is not None else self.checkpoint_state()
        if self.fail:
            raise OSError("disk full")
        self.saved.append(state)
        path = self.root / f"step_{state['step']:06d}"
        path.mkdir(parents=True)
        (path / TRAINER_STATE).write_text(json.dumps(state))
        return path


def _preemption(tmp_path, deadline_s: float = 10.0, enabled: bool = True):
    lines, exits, now = [], [], [100.0]
    config = SimpleNamespace(enabled=enabled, deadline_s=deadline_s)
    p = Preemption(config, tmp_path, lines.append, exit_process=exits.append, clock=lambda: now[0])
    return p, lines, exits, now


def test_preempt_sigterm_in_generation_abandons_the_step_and_checkpoints_the_step_before(tmp_path):
    p, lines, _, _ = _preemption(tmp_path)
    job = FakeJob(tmp_path, step=2)
    p.between_steps(job)  # step 3 starts from step 2's state
    job.step = 3
    with pytest.raises(Preempted) as stopped:
        with p.step_in_flight(job):
            job.checkpoint_state = lambda: pytest.fail("the state at the step's start is written, not now's")
            p._on_sigterm(signal.SIGTERM, None)  # as Python calls the handler, between two bytecodes
            pytest.fail("the window was not abandoned")
    assert job.saved == [{"step": 2, "sampler": {"offset": 4}}]
    assert (stopped.value.step, stopped.value.written, stopped.value.exit_code) == (2, True, PREEMPTED_EXIT_CODE)
    assert stopped.value.checkpoint == tmp_path / "step_000002" == latest_checkpoint(tmp_path)
    assert any("step 3 abandoned before its update" in line for line in lines), lines
    assert all("\n" not in line for line in lines)


def test_preempt_sigterm_once_the_update_began_finishes_the_step(tmp_path):
    p, lines, _, _ = _preemption(tmp_path)
    job = FakeJob(tmp_path, step=0)
    p.between_steps(job)
    job.step = 1
    with p.step_in_flight(job):
        p.update_begins()
        p._on_sigterm(signal.SIGTERM, None)  # counted only: the step goes on
    assert p.requested and job.saved == []
    with pytest.raises(Preempted) as stopped:
        p.between_steps(job)  # the next safe point: the finished step's checkpoint
    assert job.saved == [{"step": 1, "sampler": {"offset": 2}}] and stopped.value.written


def test_preempt_a_checkpoint_already_complete_is_not_written_again(tmp_path):
    p, lines, _, _ = _preemption(tmp_path)
    job = FakeJob(tmp_path, step=4)
    job.save_checkpoint()  # checkpoint.every_steps wrote it
    p._on_sigterm(signal.SIGTERM, None)
    with pytest.raises(Preempted) as stopped:
        p.between_steps(job)
    assert len(job.saved) == 1 and not stopped.value.written and stopped.value.step == 4
    assert any("already complete" in line for line in lines)


@pytest.mark.parametrize("where", ["start-up", "step 1"])
def test_preempt_before_anything_was_trained_writes_nothing(tmp_path, where):
    p, lines, _, _ = _preemption(tmp_path)
    job = FakeJob(tmp_path, step=0)
    with pytest.raises(Preempted) as stopped:
        if where == "start-up":
            with p.abortable(job):
                p._on_sigterm(signal.SIGTERM, None)
        else:
            p.between_steps(job)
            job.step = 1
            with p.step_in_flight(job):
                p._on_sigterm(signal.SIGTERM, None)
    assert job.saved == [] and stopped.value.checkpoint is None and stopped.value.step == 0
    assert "no checkpoint yet" in str(stopped.value)
    assert any("nothing to checkpoint" in line for line in lines)


def test_preempt_a_signal_just_before_a_window_opens_abandons_it_at_once(tmp_path):
    p, _, _, _ = _preemption(tmp_path)
    job = FakeJob(tmp_path, step=0)
    p._on_sigterm(signal.SIGTERM, None)
    ran = []
    with pytest.raises(Preempted):
        with p.abortable(job):
            ran.append(True)
    assert ran == []


def test_preempt_a_failing_checkpoint_is_one_line_and_the_previous_stays_the_latest(tmp_path):
    p, lines, _, _ = _preemption(tmp_path)
    FakeJob(tmp_path, step=2).save_checkpoint()
    job = FakeJob(tmp_path, step=3, fail=True)
    p._on_sigterm(signal.SIGTERM, None)
    with pytest.raises(Preempted) as stopped:
        p.between_steps(job)
    assert not stopped.value.written and stopped.value.checkpoint == tmp_path / "step_000002"
    assert "preemption: the checkpoint of step 3 failed: OSError: disk full" in lines


def test_preempt_watchdog_says_each_signal_once_and_ends_the_process_at_the_deadline(tmp_path):
    p, lines, exits, now = _preemption(tmp_path, deadline_s=30)
    p.check_deadline()
    assert lines == [] and exits == []
    p._on_sigterm(signal.SIGTERM, None)
    now[0] += 5
    p._on_sigterm(signal.SIGTERM, None)
    p.check_deadline()
    p.check_deadline()
    assert len(lines) == 2 and exits == []
    assert "SIGTERM received" in lines[0] and "deadline_s=30 s" in lines[0]
    assert "SIGTERM again (2 received): ignored" in lines[1] and "(25 s left)" in lines[1]
    now[0] += 25  # 30 s after the first
    p.check_deadline()
    p.check_deadline()
    assert exits == [PREEMPTED_EXIT_CODE]  # once
    assert "deadline_s=30 s passed" in lines[-1] and "the checkpoint was not complete" in lines[-1]
    assert "latest complete checkpoint is none" in lines[-1] and "\n" not in lines[-1]


def test_preempt_armed_installs_the_handler_and_restores_it_unless_a_preemption_is_under_way(tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    p, _, _, _ = _preemption(tmp_path)
    with p.armed():
        assert signal.getsignal(signal.SIGTERM) == p._on_sigterm
        assert any(t.name == "preemption-watchdog" for t in threading.enumerate())
    assert signal.getsignal(signal.SIGTERM) == before
    assert not any(t.name == "preemption-watchdog" for t in threading.enumerate())
    off, _, _, _ = _preemption(tmp_path, enabled=False)
    with off.armed():
        assert signal.getsignal(signal.SIGTERM) == before
    going, _, _, _ = _preemption(tmp_path)
    try:
        with going.armed():
            going._on_sigterm(signal.SIGTERM, None)
        assert signal.getsignal(signal.SIGTERM) == going._on_sigterm  # kept until the process ends
    finally:
        going.disarm()
    assert signal.getsignal(signal.SIGTERM) == before


def test_preempt_step_aborted_passes_through_except_exception():
    assert not issubclass(StepAborted, Exception)  # a reward function's ``except Exception`` cannot swallow it


def test_preempt_spec_defaults_and_bounds(tmp_path):
    from cluster.spec import SpecError, load_spec

    base = "output_dir: runs/t\ntotal_steps: 3\ndata: {train_path: t.jsonl}\n"
    path = tmp_path / "job.yaml"
    path.write_text(base)
    assert load_spec(path).checkpoint.on_preempt.model_dump() == {"enabled": True, "deadline_s": 120.0}
    path.write_text(base + "checkpoint:\n  on_preempt: {deadline_s: 45}\n")
    assert load_spec(path).checkpoint.on_preempt.deadline_s == 45.0
    for bad, field in (("{deadline_s: 0}", "deadline_s"), ("{deadline_s: -3}", "deadline_s"),
                       ("{dedline_s: 3}", "dedline_s"), ("{enabled: maybe}", "enabled")):
        path.write_text(base + f"checkpoint:\n  on_preempt: {bad}\n")
        with pytest.raises(SpecError, match=rf"job.yaml:5: checkpoint.on_preempt.{field}"):
            load_spec(path)


def test_preempt_run_exits_75_with_a_one_line_resume_hint(tmp_path, monkeypatch, capsys):
    """``grpo-cluster run job.yaml --set total_steps=3`` whose job is preempted: the CLI's message and code."""
    import cluster.cli as cli
    import cluster.ray_shell.ray_init as ray_init
    import cluster.ray_shell.restarts as restarts

    job = SimpleNamespace(spec=SimpleNamespace(), output_dir=tmp_path)

    def preempted(*args, **kwargs):
        raise Preempted(2, tmp_path / "step_000002", True)

    monkeypatch.setattr(cli, "prepare_job", lambda args: (job, None, "local"))
    monkeypatch.setattr(ray_init, "init_ray", lambda *args, **kwargs: None)
    monkeypatch.setattr(restarts, "run_with_restarts", preempted)
    monkeypatch.delenv("GRPO_CLUSTER_JOB_ID", raising=False)
    assert cli.main(["run", "job.yaml", "--set", "total_steps=3"]) == PREEMPTED_EXIT_CODE == 75
    err = capsys.readouterr().err.strip()
    assert err == (f"grpo-cluster: preempted by SIGTERM (exit code 75): wrote checkpoint {tmp_path}/step_000002 "
                   f"(step 2); continue with `grpo-cluster run job.yaml --set total_steps=3 --resume`")


class FilesTrainer:
    """A train side whose checkpoint part is one weights file."""

    def save_checkpoint(self, folder, checkpoint=None):
        (Path(folder) / "model.safetensors").write_bytes(b"new weights")


@pytest.mark.parametrize("how", ["replaced", "pruned"])
def test_preempt_killed_while_deleting_a_checkpoint_never_leaves_it_looking_complete(tmp_path, monkeypatch, how):
    """A checkpoint replaced (its step saved again, e.g. after a rollback) or pruned (``keep_last``) is deleted file
    by file; a process killed in the middle must not leave ``step_N`` holding ``trainer_state.json`` without its
    weights, which a resume would take for complete."""
    import shutil

    from cluster.loop.checkpoint_state import prune_checkpoints, write_checkpoint

    root = tmp_path / "checkpoints"
    for step in (1, 2, 3):
        folder = root / f"step_{step:06d}"
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(b"weights")
        (folder / TRAINER_STATE).write_text(json.dumps({"step": step}))

    def killed(path, *args, **kwargs):  # deletes the weights first, then the process dies
        (Path(path) / "model.safetensors").unlink()
        raise SystemExit("killed")

    monkeypatch.setattr(shutil, "rmtree", killed)
    with pytest.raises(SystemExit):
        if how == "replaced":
            write_checkpoint(root, 3, FilesTrainer(), str(tmp_path), "name: x\n", {"step": 3}, keep_last=None)
        else:
            prune_checkpoints(root, keep_last=2)
    monkeypatch.undo()
    for done in complete_checkpoints(root):  # what a resume may take
        assert (done / "model.safetensors").is_file(), f"{done.name} looks complete without its weights"
    assert latest_checkpoint(root) == root / ("step_000002" if how == "replaced" else "step_000003")
    write_checkpoint(root, 3, FilesTrainer(), str(tmp_path), "name: x\n", {"step": 3}, keep_last=2)  # clears up
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000002", "step_000003"]
    assert (root / "step_000003" / "model.safetensors").read_bytes() == b"new weights"
    remove_checkpoint(root / "step_000002")
    assert latest_checkpoint(root) == root / "step_000003"


def test_preempt_submit_leaves_ray_job_stop_time_for_the_checkpoint(tmp_path):
    """``grpo-cluster submit``: Ray's JobSupervisor reads ``RAY_JOB_STOP_WAIT_TIME_S`` from the job's runtime env
    (SIGKILL that long after the SIGTERM of ``ray job stop``; default 3 s): deadline + margin, unless ``--env``
    sets it; none when ``on_preempt`` is off."""
    import importlib.util

    from cluster.loop.preemption import RAY_STOP_WAIT_ENV, SHUTDOWN_MARGIN_S
    from cluster.ops import jobs
    from cluster.spec import load_spec

    supervisor = Path(importlib.util.find_spec("ray").origin).parent / "dashboard/modules/job/job_supervisor.py"
    assert f'"{RAY_STOP_WAIT_ENV}"' in supervisor.read_text()  # the name Ray reads (not imported: no Ray here)

    class Client:
        def submit_job(self, **kwargs):
            self.env = kwargs["runtime_env"]["env_vars"]
            return kwargs["submission_id"]

    project = tmp_path / "project"
    (project / "cluster").mkdir(parents=True)
    (project / "cluster" / "cli.py").write_text("")
    path = tmp_path / "job.yaml"
    for extra, env, expected in (("{deadline_s: 44.5}", {}, str(45 + SHUTDOWN_MARGIN_S)),
                                 ("{}", {RAY_STOP_WAIT_ENV: "600"}, "600"),
                                 ("{enabled: false}", {}, None)):
        path.write_text(f"output_dir: /runs/t\ntotal_steps: 3\ndata: {{train_path: t.jsonl}}\n"
                        f"checkpoint: {{on_preempt: {extra}}}\n")
        client = Client()
        jobs.submit_spec(client, load_spec(path), env=env, working_dir=project)
        assert client.env.get(RAY_STOP_WAIT_ENV) == expected, (extra, client.env)


@pytest.mark.parametrize("cmdline, driver", [
    (["/usr/local/bin/python", "/usr/local/bin/grpo-cluster", "run", "/config/spec.yaml", "--address", "auto"], True),
    (["grpo-cluster", "run", "job.yaml"], True),
    (["/venv/bin/python", "-m", "cluster.cli", "run", "grpo_job_spec.yaml", "--address", "auto"], True),
    (["/bin/sh", "-c", "grpo-cluster run /config/spec.yaml"], False),  # the shell around it: not signalled
    (["grpo-cluster", "submit", "job.yaml"], False),
    (["python", "-m", "cluster.cli", "eval", "--spec", "run"], False),
    (["ray::IDLE"], False),
])
def test_preempt_prestop_hook_finds_drivers_by_their_command_line(cmdline, driver):
    from cluster.ops.prestop import is_busy_actor, is_driver

    assert is_driver(cmdline) is driver
    assert not is_busy_actor(cmdline)


def test_preempt_prestop_hook_finds_busy_actors_only():
    from cluster.ops.prestop import is_busy_actor

    assert is_busy_actor(["ray::FSDPWorker.train_step"]) and is_busy_actor(["ray::RolloutEngine", ""])
    assert not is_busy_actor(["ray::IDLE"]) and not is_busy_actor(["/usr/bin/raylet", "--node_ip_address=x"])


def test_preempt_prestop_hook_signals_a_driver_and_waits_for_its_exit(tmp_path):
    """A stand-in driver that takes 1 s to exit after SIGTERM (as a job writes its checkpoint): the hook waits for
    it. Only this test's own process is given to the hook (other jobs may run on this machine)."""
    import subprocess
    import sys
    import time

    import psutil

    from cluster.ops.prestop import is_driver, stop_drivers

    code = ("import signal, sys, time\n"
            "signal.signal(signal.SIGTERM, lambda *a: (time.sleep(1), sys.exit(75)))\n"
            "print('ready', flush=True)\n"
            "time.sleep(60)\n")
    child = subprocess.Popen([sys.executable, "-c", code, "-m", "cluster.cli", "run", "job.yaml"],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        proc = psutil.Process(child.pid)
        assert is_driver(proc.cmdline())
        lines: list[str] = []
        started = time.monotonic()
        assert stop_drivers([proc], timeout_s=30, say=lines.append) == 0
        assert 1.0 <= time.monotonic() - started < 30  # waited for the exit (psutil collected its status)
        assert lines == [f"preStop: SIGTERM sent to the grpo-cluster driver {child.pid}",
                         "preStop: 1 driver(s) exited, 0 still running after 30 s"]
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_preempt_abort_raised_through_ray_as_a_plain_keyboard_interrupt_is_still_the_abort(tmp_path):
    """Inside ``ray.get``/``ray.wait`` Ray runs the handler and raises a new ``KeyboardInterrupt`` in place of any
    KeyboardInterrupt it raised; a Ctrl-C (no SIGTERM) stays a KeyboardInterrupt."""
    p, _, _, _ = _preemption(tmp_path)
    job = FakeJob(tmp_path, step=0)
    with pytest.raises(KeyboardInterrupt) as ctrl_c:
        with p.abortable(job):
            raise KeyboardInterrupt()
    assert not isinstance(ctrl_c.value, Preempted) and not p.requested
    with pytest.raises(Preempted):
        with p.abortable(job):
            try:
                p._on_sigterm(signal.SIGTERM, None)
            except StepAborted:
                raise KeyboardInterrupt() from None  # what ray._raylet.check_status raises after the handler
