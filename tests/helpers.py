"""Run the model directly on a paged cache: what the runner does, minus sampling."""

from __future__ import annotations

import torch

from specdecode.cache import BlockManager, KVCache, SeqBlocks
from specdecode.models.attention import build_metadata


class Runner:
    """Drives a LlamaModel over several sequences; `feed` appends tokens and returns logits."""

    def __init__(self, model, num_blocks: int = 64, block_size: int = 4):
        self.model = model
        dtype = model.activation_dtype
        self.manager = BlockManager(num_blocks, block_size)
        self.cache = KVCache(model.config, num_blocks, block_size, dtype)

    def new_seq(self) -> SeqBlocks:
        return SeqBlocks()

    @torch.inference_mode()
    def feed(self, seqs, tokens, positions=None, trees=None, commit=True, capture=()):
        """tokens[i]: list of new token ids of seqs[i]. Returns per-sequence logits [n_i, V]."""
        nums = [len(t) for t in tokens]
        for s, n in zip(seqs, nums, strict=True):
            assert self.manager.allocate(s, s.length + n)
        if positions is None:
            positions = [
                list(range(s.length, s.length + n)) for s, n in zip(seqs, nums, strict=True)
            ]
        meta = build_metadata(self.cache.kv, self.manager, seqs, nums, trees)
        ids = torch.tensor([t for ts in tokens for t in ts])
        pos = torch.tensor([p for ps in positions for p in ps])
        out = self.model(ids, pos, meta, capture_layers=capture)
        logits = self.model.compute_logits(out.hidden).split(nums)
        if commit:
            for s, n in zip(seqs, nums, strict=True):
                s.length += n
        return (list(logits), out) if capture else list(logits)


def ancestor_mask(parents: list[int]) -> torch.Tensor:
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
    return mask


def depth(parents: list[int], i: int) -> int:
    d = 0
    while parents[i] >= 0:
        i, d = parents[i], d + 1
    return d


def path_to(parents: list[int], i: int) -> list[int]:
    path = []
    while i >= 0:
        path.append(i)
        i = parents[i]
    return path[::-1]


# A tree of 6 nodes (flattened, parents before children):
#        root(0)
#       /       \
#     1           2
#    / \          |
#   3   4         5
PARENTS = [-1, 0, 0, 1, 1, 2]


def _head_target_config():
    from specdecode.config import ModelConfig

    return ModelConfig.from_hf(
        dict(
            architectures=["LlamaForCausalLM"],
            vocab_size=96,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=128,
            rms_norm_eps=1e-6,
        )
    )


# A tiny target configuration for head unit tests (random weights built by the tests).
HEAD_TARGET_CONFIG = _head_target_config()

# A head layer (config.json fields) shaped unlike that target's layers, as speculators and
# SafeAILab heads may be: a wider MLP, fewer and larger heads, its own RoPE base and eps.
OWN_HEAD_LAYER = dict(
    intermediate_size=80,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=24,
    rope_theta=5e5,
    rms_norm_eps=1e-5,
)


def chi_square_pvalue(x: list[int], y: list[int]) -> float:
    """Two-sample chi-square test of homogeneity over the tokens seen at least 5 times."""
    v = max(max(x), max(y)) + 1
    cx = torch.bincount(torch.tensor(x), minlength=v).double()
    cy = torch.bincount(torch.tensor(y), minlength=v).double()
    keep = (cx + cy) >= 5
    other = torch.stack([cx[~keep].sum(), cy[~keep].sum()])
    table = torch.stack([cx[keep], cy[keep]], 1)
    if other.sum() > 0:
        table = torch.cat([table, other[None]])
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    stat = ((table - expected) ** 2 / expected).sum()
    df = (table.shape[0] - 1) * (table.shape[1] - 1)
    return float(torch.special.gammaincc(torch.tensor(df / 2.0), stat / 2))


def seeded_params(seed: int, max_tokens: int, mix) -> list:
    """One seeded SamplingParams per (temperature, top_k) of `mix`, seeds from `seed` on."""
    from specdecode import SamplingParams

    return [
        SamplingParams(
            temperature=t, top_k=k, seed=seed + i, max_tokens=max_tokens, ignore_eos=True
        )
        for i, (t, k) in enumerate(mix)
    ]


def assert_seeded_outputs_match(plain, spec, prompts, params, alone: int) -> None:
    """`spec` samples the tokens `plain` does, batched and for prompt `alone` on its own."""
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, params)] == want
    assert spec.generate(prompts[alone], params[alone])[0].outputs[0].token_ids == want[alone]


def train_tiny_heads(plain, model_dir, root, device: str = "cpu"):
    """Self-distillation data from `plain` (an LLM of the tiny model at `model_dir`), then
    Medusa, EAGLE and EAGLE-3 heads trained on it on `device`: (root, {kind: history})."""
    from specdecode.models.loader import load_model
    from specdecode.train.datagen import generate
    from specdecode.train.heads import HeadTrainConfig, train_eagle, train_eagle3, train_medusa

    convs = [
        (f"c{i}", [{"role": "user", "content": f"say {i % 7} {i % 5} {i}"}]) for i in range(40)
    ]
    generate(plain, convs, root / "data", shard_size=16, max_tokens=24, feature_layers=(0, 1))
    target = load_model(model_dir, device=device).model.requires_grad_(False)
    cfg = HeadTrainConfig(
        draft_vocab=64, steps=60, batch_tokens=512, lr=3e-3, warmup=5, eval_examples=8
    )
    trainers = {"medusa": train_medusa, "eagle": train_eagle, "eagle3": train_eagle3}
    return root, {k: fn(target, root / "data", root / k, cfg, [2]) for k, fn in trainers.items()}
