"""torchtitan's Llama3 at a flavor of your choice, on hier_localsgd.

The model is torchtitan's own ``Transformer`` built from ``llama3_args[flavor]`` (sdpa
attention: it trains on CPU too); the data is a text file as UTF-8 bytes; the LR schedule
and data position heal with the model.

    hier-localsgd demo run.program=examples/torchtitan_llama3.py data=text data.path=corpus.txt model.name=llama3_debugmodel

Knobs: model.name=llama3_<flavor> (torchtitan's flavors: debugmodel, 8B, 70B, 405B),
train.steps, train.batch_size, train.seq_len, train.lr, train.seed, data.path.
"""

import copy

import torch
import torch.nn.functional as F
from torchtitan.models.llama3 import Transformer, llama3_args

import hier_localsgd
from hier_localsgd import HierarchicalDiLoCo, Topology


class Batches:
    """Consecutive windows of this rank's shard of the bytes; the position heals with the model."""

    def __init__(self, data: torch.Tensor, batch: int, seq_len: int, shard: int, shards: int, device: torch.device) -> None:
        per = len(data) // shards
        self.data = data[shard * per : (shard + 1) * per]
        self.batch, self.seq_len, self.device = batch, seq_len, device
        self.position = 0

    def next(self) -> tuple:
        span = self.batch * (self.seq_len + 1)
        start = (self.position * span) % max(1, len(self.data) - span)
        self.position += 1
        chunk = self.data[start : start + span].view(self.batch, self.seq_len + 1)
        return chunk[:, :-1].to(self.device), chunk[:, 1:].to(self.device)

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, sd: dict) -> None:
        self.position = int(sd["position"])


def build(flavor: str, seq_len: int, seed: int) -> Transformer:
    if flavor not in llama3_args:
        raise SystemExit(f"model.name=llama3_{flavor}: unknown flavor (torchtitan has {sorted(llama3_args)})")
    args = copy.deepcopy(llama3_args[flavor])
    args.max_seq_len, args.vocab_size = seq_len, max(256, args.vocab_size)
    torch.manual_seed(seed)  # the same initial model in every replica group
    model = Transformer(args)
    with torch.no_grad():
        model.init_weights()
    return model


@torch.no_grad()
def evaluate(model: Transformer, data: torch.Tensor, seq_len: int, device: torch.device) -> float:
    n = min(8, (len(data) - 1) // (seq_len + 1))
    chunk = data[: n * (seq_len + 1)].view(n, seq_len + 1).to(device)
    return float(F.cross_entropy(model(chunk[:, :-1]).flatten(0, 1), chunk[:, 1:].flatten()))


def main(topology: Topology) -> None:
    cfg, tr = topology.config, topology.config.train
    flavor = cfg.model.name.removeprefix("llama3_")
    with open(cfg.data.path, "rb") as f:
        data = torch.tensor(list(f.read()), dtype=torch.long)
    split = int(len(data) * 0.95)
    model = build(flavor, tr.seq_len, tr.seed).to(topology.device)
    opt = torch.optim.AdamW(model.parameters(), lr=tr.lr, betas=(tr.beta1, tr.beta2), weight_decay=tr.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20))
    batches = Batches(data[:split], tr.batch_size, tr.seq_len, topology.data_shard, topology.num_shards, topology.device)

    with HierarchicalDiLoCo(model, opt, topology, state={"scheduler": sched, "data": batches}) as sync:
        start = evaluate(model, data[split:], tr.seq_len, topology.device)
        sync.record_eval(start)
        for step in sync.steps():
            x, y = batches.next()
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            loss.backward()
            sync.record_loss(loss)
            opt.step()
            sched.step()
            opt.zero_grad()
        sync.finish()
        final = evaluate(model, data[split:], tr.seq_len, topology.device)
        sync.record_eval(final)
        sync.publish_result(eval_loss_start=start, eval_loss=final, scheduler_steps=sched.last_epoch, data_position=batches.position)


if __name__ == "__main__":
    hier_localsgd.run(main)
