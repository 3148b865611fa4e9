"""The fine-tuning loop: LoRA + new sentinel rows, bf16 autocast on CPU, gradient
accumulation, cosine schedule, a wall-clock budget and checkpoints that resume.

Run folder layout (`--out`):

    checkpoint/   adapter (fp32) + optimizer state (safetensors) + state.json — the resume point
    adapter/      the exported adapter (bf16, efim-lora/1), refreshed at every checkpoint
    train_log.jsonl   one line per optimizer step

A run resumes from `checkpoint/` when it exists, with the same data stream (sample i is a
pure function of the seed and i) and the same schedule; the hyper-parameters stored in
state.json win over the command line for anything that would change the run's meaning.

With `workers` > 1 the run is data-parallel (`efim_tools.training.parallel`): worker k of N
takes samples i ≡ k (mod N) of each step's share, and the summed gradients make the same
optimizer step one process would take on the same samples.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch.nn import functional as F

from efim_tools.training import lora as lora_mod
from efim_tools.training.base import base_model_dir, load_causal_lm, load_tokenizer
from efim_tools.training.data import Corpus, training_files
from efim_tools.training.parallel import Group, run_workers
from efim_tools.training.samples import SENTINELS, Sample, SampleBuilder, SampleConfig

log = logging.getLogger(__name__)


class TrainConfig(NamedTuple):
    model: str = "default"
    out: str = "runs/efim"
    fragment: bool = True
    fragment_prob: float = 0.5
    steps: int = 400  # planned optimizer steps (the cosine schedule's length)
    accum: int = 8  # samples per optimizer step
    lr: float = 3e-4
    embed_lr: float = 1e-3
    warmup: int = 10
    rank: int = 16
    alpha: float = 32.0
    min_window: int = 256
    max_window: int = 512
    seed: int = 0
    time_budget: float = 0.0  # seconds of training in this invocation; 0 = until `steps`
    save_every: int = 10  # optimizer steps between checkpoints
    threads: int = 0  # torch intra-op threads; 0 = torch's default
    bf16: bool = True
    line_start_prob: float = 0.5  # middles starting at a line start / after indentation
    init_from: str = ""  # warm start: a run folder whose checkpoint adapter seeds this run
    fim_rate: float = 0.45  # sample mix: FIM, EFIM, and plain left-to-right for the rest
    efim_rate: float = 0.35
    suffix_informed_prob: float = 0.0  # middles that introduce a name the suffix uses
    blank_middle_keep: float = 1.0  # share of middles starting on a blank line that are kept
    healed_prob: float = 0.0  # samples built as serving's token healing prompts the model
    layout: str = "psm"  # "psm" (<fim_*>, prefix first) or "spm" (<spm_*>, suffix first)
    workers: int = 1  # data-parallel processes (this invocation's, like threads)
    crossfile_prob: float = 0.0  # FIM/EFIM samples at cross-file spots with context chunks (issue #33)
    crossfile_packages: tuple[str, ...] = ()  # their packages (default: crossfile.TRAINING_PACKAGES)
    context_tokens: int = 1024  # the most chunk tokens a cross-file sample carries
    next_edit_prob: float = 0.0  # next-edit probe samples (efim_tools.training.next_edit; spm only)


class TrainState(NamedTuple):
    step: int = 0  # optimizer steps done
    samples: int = 0  # samples drawn (index of the next one)
    tokens: int = 0  # tokens forwarded (prompt + targets)
    target_tokens: int = 0
    seconds: float = 0.0  # training wall time over all invocations
    last_loss: float = float("nan")


class RunResult(NamedTuple):
    state: TrainState
    adapter_dir: Path
    finished: bool


def lr_at(step: int, config: TrainConfig, base_lr: float) -> float:
    if step < config.warmup:
        return base_lr * (step + 1) / config.warmup
    progress = min(1.0, (step - config.warmup) / max(1, config.steps - config.warmup))
    return base_lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def _bucket(n: int, size: int = 64) -> int:
    return -(-n // size) * size


def sample_loss(model, sample: Sample, autocast: bool, pad_id: int = 0) -> torch.Tensor:
    """Mean cross-entropy over the sample's target tokens. Logits are computed only at the
    positions that predict a target (the head is ~20% of SmolLM2's compute).

    Lengths are padded to multiples of 64 (pad tokens at the end, which causal attention
    never lets earlier positions see): oneDNN builds kernels per shape, and with a new
    length every sample the CPU spent most of its time building them (32 vs 300 tok/s)."""
    n = len(sample.ids)
    ids = torch.full((1, _bucket(n)), pad_id, dtype=torch.long)  # [1, Tp]
    ids[0, :n] = torch.tensor(sample.ids)
    where = torch.tensor(sample.targets[1:]).nonzero().squeeze(1)  # [N] positions predicting a target
    labels = ids[0, where + 1]  # [N]
    n_tgt = where.numel()
    rows = torch.cat([where, where.new_zeros(_bucket(n_tgt) - n_tgt)])  # [Np] padded with position 0
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        hidden = model.model(input_ids=ids).last_hidden_state[0]  # [Tp, D]
        logits = model.lm_head(hidden[rows])  # [Np, V+k]
    return F.cross_entropy(logits[:n_tgt].float(), labels)


def _save_checkpoint(out: Path, model, optimizer, state: TrainState, config: TrainConfig, meta: dict[str, Any]) -> None:
    from safetensors.torch import save_file  # noqa: PLC0415

    tmp = out / "checkpoint.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in lora_mod.adapter_tensors(model).items()}, str(tmp / "adapter.safetensors"))
    opt = optimizer.state_dict()
    tensors = {}
    for idx, st in opt["state"].items():
        for name, value in st.items():
            tensors[f"{idx}.{name}"] = torch.as_tensor(value).contiguous()
    save_file(tensors, str(tmp / "optimizer.safetensors"))
    doc = {"state": state._asdict(), "config": config._asdict(), "param_groups": opt["param_groups"], **meta}
    (tmp / "state.json").write_text(json.dumps(doc, indent=2) + "\n")
    final = out / "checkpoint"
    old = out / "checkpoint.old"
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)


def _load_checkpoint(out: Path, model, optimizer) -> TrainState:
    from safetensors.torch import load_file  # noqa: PLC0415

    ck = out / "checkpoint"
    doc = json.loads((ck / "state.json").read_text())
    lora_mod.load_adapter_tensors(model, load_file(str(ck / "adapter.safetensors")))
    flat = load_file(str(ck / "optimizer.safetensors"))
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in flat.items():
        idx, name = key.split(".", 1)
        state.setdefault(int(idx), {})[name] = value
    optimizer.load_state_dict({"state": state, "param_groups": doc["param_groups"]})
    return TrainState(**doc["state"])


def _warm_start(source: Path, model, config: TrainConfig) -> None:
    """Seed a new run with an earlier adapter (same rank, fragment setting, layout and model):
    a run folder's checkpoint adapter, or an adapter folder (`efim-lora/1`, such as the
    shipped one). The optimizer, schedule and data stream start fresh."""
    from safetensors.torch import load_file  # noqa: PLC0415

    earlier = stored_config(source)
    if earlier is not None:
        facts = (earlier.rank, earlier.fragment, earlier.layout, earlier.model)
        weights = source / "checkpoint" / "adapter.safetensors"
    elif (source / lora_mod.CONFIG_FILE).is_file():
        adapter = json.loads((source / lora_mod.CONFIG_FILE).read_text(encoding="utf-8"))
        trained = adapter.get("training", {}).get("config", {})
        facts = (adapter.get("r"), adapter.get("fragment_trained"), adapter.get("layout", "psm"), trained.get("model", "default"))
        weights = source / lora_mod.WEIGHTS_FILE
    else:
        raise ValueError(f"--init-from {source}: neither a run (checkpoint/state.json) nor an adapter folder ({lora_mod.CONFIG_FILE})")
    ours = (config.rank, config.fragment, config.layout, config.model)
    if facts != ours:
        raise ValueError(f"--init-from {source}: rank/fragment/layout/model {'/'.join(map(str, facts))} differ from this run's {'/'.join(map(str, ours))}")
    lora_mod.load_adapter_tensors(model, load_file(str(weights)))
    log.info("warm start from %s", source)


def stored_config(out: Path) -> TrainConfig | None:
    path = Path(out) / "checkpoint" / "state.json"
    if not path.is_file():
        return None
    stored = json.loads(path.read_text())["config"]
    stored.setdefault("line_start_prob", 0.0)  # runs from before the bias drew middles uniformly
    return TrainConfig(**stored)


def train(config: TrainConfig) -> RunResult:
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    previous = stored_config(out)
    if previous is not None:
        # The run's meaning (data, method) comes from the checkpoint; only the budget,
        # thread count and save interval are this invocation's own. A `steps` above the
        # stored plan extends the run (the cosine then restarts from that position); the
        # default value means "keep the stored plan".
        steps = max(config.steps, previous.steps) if config.steps != TrainConfig().steps else previous.steps
        config = previous._replace(time_budget=config.time_budget, threads=config.threads, save_every=config.save_every, steps=steps, workers=config.workers)
        log.info("resuming %s", out)
    if config.workers > 1:
        run_workers(_train, config.workers, config, previous is not None)
        state = stored_state(out)
        return RunResult(state, out / "adapter", state.step >= config.steps)
    return _train(Group(), config, previous is not None)


def stored_state(out: Path) -> TrainState:
    return TrainState(**json.loads((Path(out) / "checkpoint" / "state.json").read_text())["state"])


def _train(group: Group, config: TrainConfig, resume: bool) -> RunResult:
    out = Path(config.out)
    threads = config.threads or (max(1, (os.cpu_count() or 1) // config.workers) if config.workers > 1 else 0)
    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(config.seed)

    model_dir = base_model_dir(config.model)
    tokenizer = load_tokenizer(model_dir)
    base_vocab = tokenizer.get_vocab_size()
    from tokenizers import AddedToken  # noqa: PLC0415

    sentinels = SENTINELS[config.layout]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in sentinels])
    added = {t: tokenizer.token_to_id(t) for t in sentinels}
    n_added = tokenizer.get_vocab_size() - base_vocab
    model = load_causal_lm(model_dir)
    if model.config.vocab_size != base_vocab:
        raise ValueError(f"model vocab {model.config.vocab_size} != tokenizer vocab {base_vocab}; cannot place the sentinel rows")
    lcfg = lora_mod.LoraConfig(config.rank, config.alpha)
    lora_mod.attach_lora(model, lcfg, n_added, seed=config.seed)
    model.train()
    emb_rows = [model.get_input_embeddings().added_rows] if n_added else []
    head_rows = [p for p in [getattr(model.lm_head, "added_rows", None)] if p is not None and all(p is not e for e in emb_rows)]
    row_ids = {id(p) for p in emb_rows + head_rows}
    lora_params = [p for p in lora_mod.trainable_parameters(model) if id(p) not in row_ids]
    optimizer = torch.optim.AdamW(
        [{"params": lora_params, "lr": config.lr, "base_lr": config.lr}, {"params": emb_rows + head_rows, "lr": config.embed_lr, "base_lr": config.embed_lr, "weight_decay": 0.0}],
        weight_decay=0.0,
        betas=(0.9, 0.99),
    )
    if resume:
        state = _load_checkpoint(out, model, optimizer)
    else:
        state = TrainState()
        if config.init_from:
            _warm_start(Path(config.init_from), model, config)

    scfg = SampleConfig(
        fragment=config.fragment,
        fragment_prob=config.fragment_prob,
        min_window_tokens=config.min_window,
        max_window_tokens=config.max_window,
        line_start_prob=config.line_start_prob,
        fim_rate=config.fim_rate,
        efim_rate=config.efim_rate,
        suffix_informed_prob=config.suffix_informed_prob,
        blank_middle_keep=config.blank_middle_keep,
        healed_prob=config.healed_prob,
        layout=config.layout,
        crossfile_prob=config.crossfile_prob,
        next_edit_prob=config.next_edit_prob,
    )
    corpus = Corpus(training_files())
    crossfile = None
    if config.crossfile_prob > 0:
        from efim_tools.training.crossfile import TRAINING_PACKAGES, CrossFileSource  # noqa: PLC0415

        crossfile = CrossFileSource(
            config.crossfile_packages or TRAINING_PACKAGES,
            lambda text: len(tokenizer.encode(text, add_special_tokens=False).ids),
            max_tokens=(min(384, config.context_tokens), config.context_tokens),
        )
    builder = SampleBuilder(tokenizer, corpus, scfg, seed=config.seed, crossfile=crossfile)
    meta = {"base_model": str(model_dir), "base_vocab_size": base_vocab, "corpus_files": len(corpus.files), "corpus_chars": corpus.chars}
    n_params = sum(p.numel() for p in lora_mod.trainable_parameters(model))
    log.info("training %d parameters (LoRA r=%d on %s + %d new rows); state %s", n_params, config.rank, ",".join(lcfg.targets), n_added, state)

    stop = {"flag": False}

    def _on_stop(signum, frame):  # finish the step, checkpoint, exit; a second Ctrl-C interrupts
        stop["flag"] = True
        signal.signal(signal.SIGINT, signal.default_int_handler)

    old_handlers = {s: signal.signal(s, _on_stop) for s in (signal.SIGTERM, signal.SIGINT)}
    started = time.monotonic()
    # Fragmenting adds tokens; longer samples are skipped. Cross-file samples carry chunks
    # (up to `context_tokens`) and a local window of up to ~650 tokens.
    # A next-edit sample adds its probe (two lines and a line's head) and the answer.
    max_len = max(config.max_window, 640 + config.context_tokens if config.crossfile_prob > 0 else 0) + 96
    max_len += 160 if config.next_edit_prob > 0 else 0
    params = lora_mod.trainable_parameters(model)
    log_file = (out / "train_log.jsonl").open("a") if group.is_main else None
    try:
        while state.step < config.steps:
            out_of_time = bool(config.time_budget) and time.monotonic() - started >= config.time_budget
            if group.max([float(stop["flag"] or out_of_time)])[0]:  # every worker stops at the same step
                break
            t0 = time.monotonic()
            for param_group in optimizer.param_groups:
                param_group["lr"] = lr_at(state.step, config, param_group["base_lr"])
            total, n_tok, n_tgt, done = 0.0, 0, 0, 0
            index, last = state.samples + group.rank, state.samples - 1
            while done < group.share(config.accum):
                sample = builder.sample(index)
                last, index = index, index + group.world
                if len(sample.ids) > max_len or sum(sample.targets) < 2:
                    continue
                loss = sample_loss(model, sample, config.bf16, builder.fim.pad)
                (loss / config.accum).backward()
                total += float(loss.detach())
                n_tok += len(sample.ids)
                n_tgt += sum(sample.targets)
                done += 1
            group.sum_grads(params)
            total, n_tok, n_tgt = group.sum([total, n_tok, n_tgt])
            samples = int(group.max([last])[0]) + 1  # past every index any worker drew
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            dt = time.monotonic() - t0
            state = TrainState(state.step + 1, samples, state.tokens + int(n_tok), state.target_tokens + int(n_tgt), state.seconds + dt, total / config.accum)
            if not group.is_main:
                continue
            record = {"step": state.step, "loss": round(state.last_loss, 4), "lr": optimizer.param_groups[0]["lr"], "tokens": state.tokens, "tok_per_s": round(n_tok / dt, 1), "seconds": round(state.seconds, 1)}
            log_file.write(json.dumps(record) + "\n")
            log_file.flush()
            log.info("step %d loss %.3f tokens %d (%.0f tok/s)", state.step, state.last_loss, state.tokens, n_tok / dt)
            if state.step % config.save_every == 0:
                _save_checkpoint(out, model, optimizer, state, config, meta)
                _export(model, out, lcfg, added, base_vocab, state, config)
    finally:
        for sig, handler in old_handlers.items():
            signal.signal(sig, handler)
        if log_file is not None:
            log_file.close()
    if group.is_main:
        _save_checkpoint(out, model, optimizer, state, config, meta)
        _export(model, out, lcfg, added, base_vocab, state, config)
    return RunResult(state, out / "adapter", state.step >= config.steps)


def _export(model, out: Path, lcfg, added, base_vocab, state: TrainState, config: TrainConfig) -> Path:
    training = {"steps": state.step, "samples": state.samples, "tokens_seen": state.tokens, "target_tokens": state.target_tokens, "seconds": round(state.seconds, 1), "config": config._asdict()}
    earlier = _earlier_rounds(config)
    if earlier:
        # A warm-started run: the adapter has also seen what its seed run saw.
        training["earlier_rounds"] = earlier
        training["total_tokens_seen"] = state.tokens + sum(r["tokens_seen"] for r in earlier)
        training["total_seconds"] = round(state.seconds + sum(r["seconds"] for r in earlier), 1)
    extra = {"fragment_trained": config.fragment, "layout": config.layout, "training": training}
    healing = _serving_healing(config)
    if healing is not None:
        extra["healing"] = healing
    if config.next_edit_prob > 0 or _seed_config(config).get("next_edit") == "probe":
        extra["next_edit"] = "probe"  # trained on next-edit probes (engine.adapters.adapter_probes)
    return lora_mod.save_adapter(model, out / "adapter", lcfg, added, base_vocab, extra=extra)


def _serving_healing(config: TrainConfig) -> str | None:
    """Whether serving should heal prompts for this run's adapter (`"healing"` in its config,
    read by `engine.adapters.adapter_heals`), when the run knows: "on" when it was trained
    on healed prompts, else what the adapter it was warm-started from says. None leaves it
    to serving's default (off for a fragment-trained adapter) until a card measures it."""
    if config.healed_prob > 0:
        return "on"
    healing = _seed_config(config).get("healing")
    return healing if healing in ("on", "off") else None


def _seed_config(config: TrainConfig) -> dict[str, Any]:
    """The adapter config of the adapter this run was warm-started from ({} when none)."""
    if config.init_from:
        for folder in (Path(config.init_from), Path(config.init_from) / "adapter"):
            path = folder / lora_mod.CONFIG_FILE
            if path.is_file():
                return json.loads(path.read_text(encoding="utf-8"))
    return {}


def _earlier_rounds(config: TrainConfig) -> list[dict[str, Any]]:
    """The chain of runs this one was warm-started from, oldest first (from their checkpoints,
    or from the training record of an adapter folder)."""
    rounds: list[dict[str, Any]] = []
    source, seen = config.init_from, set()
    while source and source not in seen:
        seen.add(source)
        path = Path(source) / "checkpoint" / "state.json"
        if not path.is_file():
            adapter = Path(source) / lora_mod.CONFIG_FILE
            if adapter.is_file():
                training = json.loads(adapter.read_text(encoding="utf-8")).get("training", {})
                own = {"run": training.get("config", {}).get("out", source), "steps": training.get("steps", 0), "tokens_seen": training.get("tokens_seen", 0), "seconds": training.get("seconds", 0.0)}
                rounds[:0] = [*training.get("earlier_rounds", []), own]
            break
        doc = json.loads(path.read_text())
        st = doc["state"]
        rounds.insert(0, {"run": source, "steps": st["step"], "tokens_seen": st["tokens"], "seconds": round(st["seconds"], 1)})
        source = doc["config"].get("init_from", "")
    return rounds


__all__ = ["TrainConfig", "TrainState", "RunResult", "train", "lr_at", "sample_loss", "stored_config", "stored_state"]
