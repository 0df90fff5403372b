"""``local_job(spec, progress=False)``: transformers' "Loading weights" bars stay off while the job's fleet and trainer
load the model (tiny random Llama; seconds), and the libraries' own setting is back afterwards, so a notebook's own
``from_pretrained`` after the job still shows its bar."""

from __future__ import annotations

import pytest

from tests.local_runtime import local_spec


@pytest.fixture
def bars_on():
    """transformers' (and huggingface_hub's) bars on for the test, as in a fresh notebook; restored after."""
    from huggingface_hub import utils as hub_utils
    from transformers.utils import logging as hf_logging

    before = hf_logging.is_progress_bar_enabled(), hub_utils.are_progress_bars_disabled()
    hf_logging.enable_progress_bar()
    yield
    (hf_logging.enable_progress_bar if before[0] else hf_logging.disable_progress_bar)()
    (hub_utils.disable_progress_bars if before[1] else hub_utils.enable_progress_bars)()


def test_local_job_progress_false_silences_loading_bars_then_restores_them(tiny_model_dir, tmp_path, capfd, bars_on):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from cluster.in_process import local_job
    from contract.versions import PolicyVersionLedger

    data = tmp_path / "train.jsonl"
    data.write_text("".join(f'{{"question": "What is {i} + 1?", "answer": "#### {i + 1}"}}\n' for i in range(4)))
    spec = local_spec(tiny_model_dir, str(tmp_path / "out"), metrics={"port": None},
                      data={"train_path": str(data), "max_prompt_tokens": 256})
    job = local_job(spec, progress=False)
    try:  # what job.run() starts first: the train rank, then the fleet, each loading the model
        job.trainer.start(tiny_model_dir)
        job.fleet.start(tiny_model_dir, 0, job.trainer, PolicyVersionLedger(), status=lambda message: None)
    finally:
        job.close()
        job.shutdown()
    quiet = capfd.readouterr().err
    assert "Loading weights" not in quiet, quiet[-2000:]
    assert hf_logging.is_progress_bar_enabled()  # not leaked beyond the job
    AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert "Loading weights" in capfd.readouterr().err  # the bar this test looks for, shown outside the job
