"""A Hugging Face ``transformers`` causal LM on hier_localsgd.

The model is built from a config (random init: nothing is downloaded), the tokenizer is a
byte-level BPE that ``tokenizers`` trains on the local corpus, and ``datasets`` loads and
tokenizes the local text file. The LR schedule (transformers' cosine with warm-up) and the
data position heal with the model.

    hier-localsgd demo run.program=examples/hf_causal_lm.py data=text data.path=corpus.txt

Knobs: data.path (a UTF-8 text file, one example per line), train.steps,
train.batch_size, train.seq_len, train.lr, train.seed, model.dim (hidden size).
"""

import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # before tokenizers starts its threads

import torch
from datasets import load_dataset
from tokenizers import ByteLevelBPETokenizer
from transformers import AutoModelForCausalLM, LlamaConfig, get_cosine_schedule_with_warmup

import hier_localsgd
from hier_localsgd import HierarchicalDiLoCo, Topology


def tokenize(path: str, cache: str, vocab_size: int = 512) -> tuple:
    """A BPE tokenizer trained on ``path`` (the same merges in every process: the training
    is deterministic), and the file's tokens as one tensor, through ``datasets``."""
    tok = ByteLevelBPETokenizer()
    tok.train([path], vocab_size=vocab_size, min_frequency=2, show_progress=False)
    ds = load_dataset("text", data_files=path, split="train", cache_dir=cache, keep_in_memory=True)
    ds = ds.map(lambda b: {"ids": [e.ids for e in tok.encode_batch(b["text"])]}, batched=True, remove_columns=["text"],
                keep_in_memory=True)
    ids = [i for row in ds["ids"] for i in row]
    return tok, torch.tensor(ids, dtype=torch.long)


class Batches:
    """Random windows of this rank's tokens; the position heals with the model."""

    def __init__(self, ids: torch.Tensor, batch: int, seq_len: int, shard: int, seed: int, device: torch.device) -> None:
        self.ids, self.batch, self.seq_len, self.shard, self.seed, self.device = ids, batch, seq_len, shard, seed, device
        self.position = 0

    def next(self) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.shard * 7_919 + self.position)
        self.position += 1
        starts = torch.randint(len(self.ids) - self.seq_len, (self.batch,), generator=g)
        return torch.stack([self.ids[s : s + self.seq_len] for s in starts]).to(self.device)

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, sd: dict) -> None:
        self.position = int(sd["position"])


@torch.no_grad()
def evaluate(model: torch.nn.Module, ids: torch.Tensor, seq_len: int, device: torch.device) -> float:
    n = min(8, len(ids) // seq_len)
    x = ids[: n * seq_len].view(n, seq_len).to(device)
    model.eval()
    loss = float(model(input_ids=x, labels=x).loss)
    model.train()
    return loss


def main(topology: Topology) -> None:
    cfg, tr = topology.config, topology.config.train
    tok, ids = tokenize(cfg.data.path, os.path.join(cfg.run.dir, "hf_cache", f"c{topology.cluster}r{topology.replica}g{topology.rank}"))
    split = int(len(ids) * 0.95)
    config = LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=cfg.model.dim, intermediate_size=4 * cfg.model.dim,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=tr.seq_len,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
    torch.manual_seed(tr.seed)  # the same initial model in every replica group
    model = AutoModelForCausalLM.from_config(config).to(topology.device)
    opt = torch.optim.AdamW(model.parameters(), lr=tr.lr, weight_decay=tr.weight_decay)
    sched = get_cosine_schedule_with_warmup(opt, num_warmup_steps=20, num_training_steps=tr.steps)
    batches = Batches(ids[:split], tr.batch_size, tr.seq_len, topology.data_shard, tr.seed, topology.device)

    with HierarchicalDiLoCo(model, opt, topology, state={"scheduler": sched, "data": batches}) as sync:
        start = evaluate(model, ids[split:], tr.seq_len, topology.device)
        sync.record_eval(start)
        for step in sync.steps():
            x = batches.next()
            loss = model(input_ids=x, labels=x).loss
            loss.backward()
            sync.record_loss(loss)
            opt.step()
            sched.step()
            opt.zero_grad()
        sync.finish()
        final = evaluate(model, ids[split:], tr.seq_len, topology.device)
        sync.record_eval(final)
        sync.publish_result(eval_loss_start=start, eval_loss=final, scheduler_steps=sched.last_epoch, data_position=batches.position,
                            vocab_size=tok.get_vocab_size())


if __name__ == "__main__":
    hier_localsgd.run(main)
