"""The training loop on a tiny model: loss is finite, checkpoints resume the same run."""

from __future__ import annotations

import json

import pytest
import torch

from efim_tools.training.lora import read_adapter
from efim_tools.training.train import TrainConfig, lr_at, stored_config, stored_state, train


def test_train_checkpoints_and_resumes(tiny_model_factory, tmp_path):
    model_dir = tiny_model_factory("llama", fim_tokens=False)
    out = tmp_path / "run"
    cfg = TrainConfig(model=str(model_dir), out=str(out), steps=2, accum=2, min_window=24, max_window=48, warmup=1, save_every=1, threads=1)
    first = train(cfg)
    assert first.finished and first.state.step == 2 and first.state.tokens > 0
    assert stored_config(out).min_window == 24
    adapter = read_adapter(first.adapter_dir)
    assert adapter.config["training"]["steps"] == 2 and adapter.config["fragment_trained"] is True
    assert len(adapter.added_tokens) == 4

    # a later invocation continues the same run: schedule position, data stream, tokens
    second = train(cfg._replace(steps=3, min_window=999))  # stored data settings win
    assert second.state.step == 3
    assert second.state.samples >= first.state.samples + 2
    assert second.state.tokens > first.state.tokens
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2, 3]
    assert all(r["loss"] == r["loss"] and r["loss"] > 0 for r in log)  # finite, positive


def test_time_budget_stops_with_a_checkpoint(tiny_model_factory, tmp_path):
    model_dir = tiny_model_factory("llama", fim_tokens=False)
    out = tmp_path / "run"
    res = train(TrainConfig(model=str(model_dir), out=str(out), steps=1000, accum=1, min_window=24, max_window=48, time_budget=1e-9, threads=1))
    assert not res.finished and res.state.step == 0
    assert (out / "checkpoint" / "state.json").is_file()


def test_cosine_schedule_shape():
    cfg = TrainConfig(steps=100, warmup=10)
    lrs = [lr_at(s, cfg, 1.0) for s in range(100)]
    assert lrs[0] < lrs[9] == max(lrs)
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))
    assert abs(lrs[-1] - 0.1) < 0.01


def test_cli_trains_and_reports_json(tiny_model_factory, tmp_path, capsys):
    from efim_tools.cli import main

    model_dir = tiny_model_factory("llama", fim_tokens=False)
    out = tmp_path / "cli-run"
    code = main(["train", "--model", str(model_dir), "--out", str(out), "--steps", "1", "--accum", "1", "--window", "24:48", "--threads", "1", "--no-fragment"])
    assert code == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["step"] == 1 and doc["finished"] and doc["tokens"] > 0
    assert read_adapter(out / "adapter").config["fragment_trained"] is False


def test_cli_rejects_a_bad_window(tmp_path, capsys):
    from efim_tools.cli import main

    assert main(["train", "--out", str(tmp_path), "--window", "big"]) == 2
    assert "--window" in capsys.readouterr().err


def test_warm_start_seeds_a_new_run_with_an_earlier_adapter(tiny_model_factory, tmp_path):
    from safetensors.torch import load_file

    model_dir = tiny_model_factory("llama", fim_tokens=False)
    base = TrainConfig(model=str(model_dir), steps=1, accum=1, min_window=24, max_window=48, warmup=1, threads=1)
    first = tmp_path / "first"
    train(base._replace(out=str(first)))
    earlier = load_file(str(first / "checkpoint" / "adapter.safetensors"))

    # Zero training steps: the new run's checkpoint is exactly the adapter it started from.
    second = tmp_path / "second"
    res = train(base._replace(out=str(second), init_from=str(first), time_budget=1e-9, line_start_prob=1.0))
    assert res.state.step == 0
    seeded = load_file(str(second / "checkpoint" / "adapter.safetensors"))
    assert seeded.keys() == earlier.keys()
    assert all(torch.equal(seeded[k], earlier[k]) for k in earlier)
    assert stored_config(second).init_from == str(first) and stored_config(second).line_start_prob == 1.0
    training = read_adapter(res.adapter_dir).config["training"]
    first_tokens = json.loads((first / "checkpoint" / "state.json").read_text())["state"]["tokens"]
    assert [r["run"] for r in training["earlier_rounds"]] == [str(first)]
    assert training["total_tokens_seen"] == res.state.tokens + first_tokens > 0

    # A mismatched run is refused before anything is trained.
    with pytest.raises(ValueError, match="rank/fragment/layout/model"):
        train(base._replace(out=str(tmp_path / "third"), init_from=str(first), rank=4))


def test_warm_start_from_an_adapter_folder(tiny_model_factory, tmp_path):
    """A new round can start from an exported adapter (the shipped one has no run folder):
    its weights seed the run and its training record becomes the earlier round."""
    from safetensors.torch import load_file

    model_dir = tiny_model_factory("llama", fim_tokens=False)
    base = TrainConfig(model=str(model_dir), steps=1, accum=1, min_window=24, max_window=48, warmup=1, threads=1, layout="spm")
    first = train(base._replace(out=str(tmp_path / "first")))
    exported = read_adapter(first.adapter_dir)
    res = train(base._replace(out=str(tmp_path / "second"), init_from=str(first.adapter_dir), time_budget=1e-9))
    seeded = load_file(str(tmp_path / "second" / "checkpoint" / "adapter.safetensors"))
    assert seeded.keys() == exported.tensors.keys()
    assert all(torch.equal(seeded[k], exported.tensors[k].float()) for k in seeded)  # the bf16 export, widened
    training = read_adapter(res.adapter_dir).config["training"]
    assert [r["tokens_seen"] for r in training["earlier_rounds"]] == [first.state.tokens]
    assert "healing" not in exported.config  # a fragment-trained run without healed prompts: serving's default
    # Serving's healing: on for a run trained on healed prompts, else inherited from the seed adapter.
    healed = train(base._replace(out=str(tmp_path / "healed"), healed_prob=0.5, time_budget=1e-9))
    assert read_adapter(healed.adapter_dir).config["healing"] == "on"
    inherits = train(base._replace(out=str(tmp_path / "inherits"), init_from=str(healed.adapter_dir), time_budget=1e-9))
    assert read_adapter(inherits.adapter_dir).config["healing"] == "on"
    from engine.adapters import adapter_heals

    assert adapter_heals(inherits.adapter_dir) and not adapter_heals(first.adapter_dir)
    # The layout must match too: an spm adapter cannot seed a psm run.
    with pytest.raises(ValueError, match="layout"):
        train(base._replace(out=str(tmp_path / "third"), init_from=str(first.adapter_dir), layout="psm"))
    with pytest.raises(ValueError, match="neither a run"):
        train(base._replace(out=str(tmp_path / "fourth"), init_from=str(tmp_path)))


def test_runs_stored_before_line_start_bias_keep_uniform_middles(tmp_path):
    (tmp_path / "checkpoint").mkdir()
    old = TrainConfig()._asdict()
    del old["line_start_prob"], old["init_from"]
    (tmp_path / "checkpoint" / "state.json").write_text(json.dumps({"config": old}))
    assert stored_config(tmp_path).line_start_prob == 0.0


def test_cli_rejects_a_missing_init_from(tmp_path, capsys):
    from efim_tools.cli import main

    assert main(["train", "--out", str(tmp_path / "run"), "--init-from", str(tmp_path / "nowhere")]) == 2
    assert "--init-from" in capsys.readouterr().err


def test_two_workers_take_the_same_steps_as_one_process(tiny_model_factory, tmp_path):
    """Data-parallel training: worker k draws samples k, k+2, ...; the summed gradients make
    the optimizer step a single process takes on the same samples (fp32: equal to rounding)."""
    from safetensors.torch import load_file

    model_dir = tiny_model_factory("llama", fim_tokens=False)
    base = TrainConfig(model=str(model_dir), steps=2, accum=4, min_window=24, max_window=48, warmup=1, save_every=1, threads=1, bf16=False)
    one = train(base._replace(out=str(tmp_path / "one")))
    two = train(base._replace(out=str(tmp_path / "two"), workers=2))
    assert two.finished and two.state.step == 2
    assert (two.state.samples, two.state.tokens, two.state.target_tokens) == (one.state.samples, one.state.tokens, one.state.target_tokens)
    assert abs(two.state.last_loss - one.state.last_loss) < 1e-4
    a = load_file(str(tmp_path / "one" / "checkpoint" / "adapter.safetensors"))
    b = load_file(str(tmp_path / "two" / "checkpoint" / "adapter.safetensors"))
    assert a.keys() == b.keys()
    for name, t in a.items():
        torch.testing.assert_close(b[name], t, atol=1e-5, rtol=1e-4)
    assert any("lora_B" in name and t.abs().sum() > 0 for name, t in b.items())  # B starts at zero: the steps moved it
    log = [json.loads(line) for line in (tmp_path / "two" / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2]  # one log, written by worker 0


def test_cli_rejects_a_bad_mix_and_too_many_workers(tmp_path, capsys):
    from efim_tools.cli import main

    assert main(["train", "--out", str(tmp_path / "r"), "--mix", "1:2"]) != 0
    assert "--mix" in capsys.readouterr().err
    assert main(["train", "--out", str(tmp_path / "r"), "--workers", "3", "--accum", "2"]) != 0
    assert "--workers" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_sigterm_stops_all_workers_with_a_checkpoint(tiny_model_factory, tmp_path):
    """`kill <pid of efim train>` during a two-worker run: the workers finish their step,
    worker 0 checkpoints, the command exits cleanly and a later invocation resumes."""
    import signal
    import subprocess
    import sys
    import time

    model_dir = tiny_model_factory("llama", fim_tokens=False)
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "efim_tools.cli", "train", "--model", str(model_dir), "--out", str(out), "--steps", "100000",
           "--accum", "2", "--window", "24:48", "--workers", "2", "--threads", "1", "--save-every", "100000"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    log = out / "train_log.jsonl"
    deadline = time.monotonic() + 120
    while not (log.is_file() and log.read_text().count("\n") >= 2):
        assert proc.poll() is None, proc.stderr.read()
        assert time.monotonic() < deadline, "no training steps within 120 s"
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr
    doc = json.loads(stdout)
    assert doc["step"] >= 2 and not doc["finished"]
    assert stored_state(out).step == doc["step"]  # the checkpoint is the step the workers stopped at
    again = train(TrainConfig(out=str(out), time_budget=1e-9, threads=1))
    assert again.state.step == doc["step"]
