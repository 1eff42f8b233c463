"""A character-level GPT trained by its own loop, in the spirit of nanoGPT's train.py, on hpcps.

The loop stays the user's: micro-batches accumulated into one step, bf16
autocast, clipping, a validation loss every few iterations, the best one
kept, its own checkpoint fields. hpcps adds three lines: ``hpcps.init``
(the model is built on every rank, the optimizer lives on the server
shards), ``ps.step()`` where torch would call ``optimizer.step()``, and the
``with`` block that closes the run on every rank. The optimizer is AdamW
with weight decay on tensors of two or more dimensions only (nanoGPT's
rule, ``hpcps.decay_groups``), its rate warmed up and decayed by a cosine
to ``min_lr``, all on the servers. Under bsp, ssp or dssp alike::

    mpiexec -n 5 python examples/nanogpt_style.py --paradigm ssp --max-iters 200
    mpiexec -n 5 python examples/nanogpt_style.py --paradigm bsp --checkpoint-every 100 --out runs/gpt.h5
    mpiexec -n 5 python examples/nanogpt_style.py --paradigm bsp --resume runs/gpt-checkpoints/step-000100.h5

The text is ``--data FILE`` (any UTF-8 text: tiny Shakespeare, your own),
or, without one, the Zen of Python, which ships with Python.
"""

from __future__ import annotations

import argparse
import codecs
import contextlib
import io
import math

import torch
import torch.nn.functional as F
from torch import nn

import hpcps


# -- the model: a small GPT (token and position embeddings, pre-norm blocks, tied head) -----------------
class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.attn = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd),
                                 nn.Dropout(dropout))
        self.n_head, self.dropout = n_head, dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.attn(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0)
        x = x + self.proj(y.transpose(1, 2).contiguous().view(b, t, c))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, block_size: int, n_layer: int = 2, n_head: int = 4, n_embd: int = 64,
                 dropout: float = 0.1) -> None:
        super().__init__()
        self.block_size = block_size
        self.tok = nn.Embedding(vocab, n_embd)
        self.pos = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab, bias=False)
        self.head.weight = self.tok.weight  # weight tying, as GPT-2
        for module in self.modules():  # GPT-2's initialisation: small weights, zero biases
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device)))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.view(-1))


# -- the data: characters of a text, a train and a validation split -------------------------------------
def load_text(path: str | None) -> str:
    if path:
        with open(path, encoding="utf-8") as f:
            return f.read()
    with contextlib.redirect_stdout(io.StringIO()):  # importing it prints it
        import this
    return codecs.decode(this.s, "rot13")


def get_batch(data: torch.Tensor, block_size: int, batch_size: int,
              device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """nanoGPT's get_batch: random windows of the split (torch's RNG: hpcps gives every worker its own),
    on the model's device."""
    ix = torch.randint(len(data) - block_size - 1, (batch_size,))
    x = torch.stack([data[i:i + block_size] for i in ix])
    y = torch.stack([data[i + 1:i + 1 + block_size] for i in ix])
    return x.to(device, non_blocking=True), y.to(device, non_blocking=True)


@torch.no_grad()
def estimate_loss(model: nn.Module, splits: dict[str, torch.Tensor], block_size: int, batch_size: int,
                  eval_iters: int, autocast) -> dict[str, float]:
    device = next(model.parameters()).device
    model.eval()
    out = {}
    for name, data in splits.items():
        losses = []
        for _ in range(eval_iters):
            with autocast():
                losses.append(float(model(*get_batch(data, block_size, batch_size, device))))
        out[name] = sum(losses) / len(losses)
    model.train()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--paradigm", default="ssp")
    p.add_argument("--data", default=None, help="a UTF-8 text file (default: the Zen of Python)")
    p.add_argument("--max-iters", type=int, default=200)
    p.add_argument("--eval-interval", type=int, default=50, help="iterations between validation losses")
    p.add_argument("--eval-iters", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--accumulation", type=int, default=2, help="micro-batches per step")
    p.add_argument("--learning-rate", type=float, default=3e-3)
    p.add_argument("--min-lr", type=float, default=3e-4)
    p.add_argument("--warmup-iters", type=int, default=20)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-embd", type=int, default=64)
    p.add_argument("--checkpoint-every", type=int, default=None)
    p.add_argument("--resume", default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args()

    text = load_text(args.data)
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text], dtype=torch.long)
    n = int(0.9 * len(data))
    splits = {"train": data[:n], "val": data[n:]}
    ps = hpcps.init(lambda: GPT(len(chars), args.block_size, n_layer=args.n_layer, n_embd=args.n_embd),
                    optimizer="adamw", lr=args.learning_rate, betas=(0.9, 0.99),
                    param_groups=lambda model: hpcps.decay_groups(model, args.weight_decay),
                    lr_schedule="cosine", warmup_steps=args.warmup_iters, min_lr=args.min_lr,
                    paradigm=args.paradigm, steps=args.max_iters, checkpoint_every=args.checkpoint_every,
                    resume=args.resume, out=args.out)
    autocast = lambda: torch.autocast(ps.device.type, dtype=torch.bfloat16)  # noqa: E731  (cuda on a GPU worker)
    with ps:
        if ps.is_worker and ps.iteration == 0:
            ps.state.update(iter_num=0, best_val_loss=math.inf)  # the loop's own checkpoint fields
        while ps.running:
            if ps.worker_index == 0 and ps.iteration % args.eval_interval == 0:
                losses = estimate_loss(ps.model, splits, args.block_size, args.batch_size, args.eval_iters,
                                       autocast)
                ps.log(train_loss=losses["train"], val_loss=losses["val"])
                ps.state["best_val_loss"] = min(ps.state["best_val_loss"], losses["val"])
                print(f"step {ps.iteration} (version {ps.version}): train loss {losses['train']:.4f}, "
                      f"val loss {losses['val']:.4f}", flush=True)
            for _ in range(args.accumulation):
                with autocast():
                    loss = ps.model(*get_batch(splits["train"], args.block_size, args.batch_size, ps.device))
                (loss / args.accumulation).backward()
            torch.nn.utils.clip_grad_norm_(ps.model.parameters(), args.grad_clip)
            ps.state["iter_num"] = ps.iteration + 1
            ps.step(loss)
    # only workers get here: a server rank's process ended in hpcps.init, once it had served
    if ps.worker_index == 0:
        print(f"best val loss {ps.state['best_val_loss']:.4f} after {ps.state['iter_num']} iterations; "
              f"metrics in {ps.path}", flush=True)


if __name__ == "__main__":
    main()
