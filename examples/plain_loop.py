"""A plain PyTorch model and loop on hier_localsgd: a small byte-level GPT on a text file.

Everything here is the user's: the model, the optimizer, the LR schedule, the data and
the loop. hier_localsgd adds the (hierarchical) sync inside ``opt.step()``, fault tolerance,
and healing of the registered state (schedule and data position) with the model.

    hier-localsgd demo run.program=examples/plain_loop.py data.path=corpus.txt train.steps=200
    launch/replica.sh 0 0 http://coord:29510 http://a:29511,http://b:29511 data.path=corpus.txt -- python examples/plain_loop.py

Its knobs are the job's own overrides: train.steps, train.batch_size, train.seq_len,
train.lr, train.seed, model.dim, data.path (a UTF-8 text file).
"""

import torch
import torch.nn.functional as F
from torch import nn

import hier_localsgd
from hier_localsgd import HierarchicalDiLoCo, Topology


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        causal = torch.triu(torch.ones(t, t, dtype=torch.bool, device=x.device), 1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=causal, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int, seq_len: int, dim: int, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(seq_len, dim)
        self.blocks = nn.Sequential(*[Block(dim, heads) for _ in range(layers)])
        self.head = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, vocab))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        return self.head(self.blocks(x))


class Batches:
    """Random windows of this rank's data; its position is state that heals with the model."""

    def __init__(self, data: torch.Tensor, batch: int, seq_len: int, shard: int, seed: int, device: torch.device) -> None:
        self.data, self.batch, self.seq_len, self.shard, self.seed, self.device = data, batch, seq_len, shard, seed, device
        self.position = 0

    def next(self) -> tuple:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.shard * 7_919 + self.position)
        self.position += 1
        i = torch.randint(len(self.data) - self.seq_len - 1, (self.batch,), generator=g)
        x = torch.stack([self.data[j : j + self.seq_len] for j in i])
        y = torch.stack([self.data[j + 1 : j + 1 + self.seq_len] for j in i])
        return x.to(self.device), y.to(self.device)

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, sd: dict) -> None:
        self.position = int(sd["position"])


@torch.no_grad()
def evaluate(model: nn.Module, data: torch.Tensor, seq_len: int, device: torch.device) -> float:
    n = min(8, (len(data) - 1) // seq_len)
    x = torch.stack([data[k * seq_len : (k + 1) * seq_len] for k in range(n)]).to(device)
    y = torch.stack([data[k * seq_len + 1 : (k + 1) * seq_len + 1] for k in range(n)]).to(device)
    return float(F.cross_entropy(model(x).flatten(0, 1), y.flatten()))


def main(topology: Topology) -> None:
    cfg, tr = topology.config, topology.config.train
    with open(cfg.data.path, "rb") as f:
        data = torch.tensor(list(f.read()), dtype=torch.long)
    split = int(len(data) * 0.95)
    torch.manual_seed(tr.seed)  # the same initial model in every replica group
    model = TinyGPT(256, tr.seq_len, cfg.model.dim).to(topology.device)
    opt = torch.optim.AdamW(model.parameters(), lr=tr.lr, weight_decay=tr.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20))  # warm-up
    batches = Batches(data[:split], tr.batch_size, tr.seq_len, topology.data_shard, tr.seed, topology.device)

    with HierarchicalDiLoCo(model, opt, topology, state={"scheduler": sched, "data": batches}) as sync:
        start = evaluate(model, data[split:], tr.seq_len, topology.device)
        sync.record_eval(start)
        for step in sync.steps():
            x, y = batches.next()
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            loss.backward()
            sync.record_loss(loss)
            opt.step()  # a sync round at round boundaries
            sched.step()
            opt.zero_grad()
        sync.finish()
        final = evaluate(model, data[split:], tr.seq_len, topology.device)
        sync.record_eval(final)
        sync.publish_result(eval_loss_start=start, eval_loss=final, scheduler_steps=sched.last_epoch, data_position=batches.position)


if __name__ == "__main__":
    hier_localsgd.run(main)
