"""Decides which sequences run in the next step and how many tokens each feeds. No tensors.

Running sequences decode first (one token each, with room for a draft tree where it fits; a tree
that does not fit is dropped before anything is preempted, and takes what the free blocks hold
once the waiting sequences are admitted); if the cache cannot
hold them, the most recently admitted one is preempted (its blocks freed, it goes back to the
front of the queue and is recomputed later: no request is ever lost). Then waiting sequences
are admitted, prefilled in chunks of at most `max_num_batched_tokens` tokens per step.

Under the priority policy (vLLM's `--scheduling-policy priority`) the queue is kept in order of
each request's priority (lower first), then arrival, and the request preempted is the running
one that comes last in that order (its place in this step's batch given back). A running
request is not preempted only to admit a waiting one, as in vLLM.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from specdecode.cache import BlockManager
from specdecode.core import Sequence, SequenceStatus
from specdecode.errors import OutOfMemoryError


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    num_new: list[int]  # tokens each sequence feeds this step (prefill chunk, or 1)
    # seq_id -> cache slots each decoding sequence holds for its draft tree this step (at most
    # the lookahead asked for). A short cache gives fewer, or none: the sequence drafts a
    # smaller tree, or decodes one token without drafts, rather than preempt a request for
    # slots drafts may not use.
    draft_slots: dict[int, int] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.seqs)


class Scheduler:
    def __init__(
        self, manager: BlockManager, max_num_seqs: int = 256, max_num_batched_tokens: int = 2048,
        policy: str = "fcfs",
    ) -> None:  # fmt: skip
        self.manager = manager
        self.policy = policy
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.on_preempt: list = []  # callbacks(seq), e.g. a drafter dropping its state

    def add(self, seq: Sequence) -> None:
        if seq.num_tokens + 1 > self.manager.capacity_tokens:
            raise OutOfMemoryError(
                f"a sequence of {seq.num_tokens} tokens does not fit the KV cache "
                f"({self.manager.capacity_tokens} tokens); raise the KV cache memory"
            )
        self._queue(seq)

    @staticmethod
    def _rank(seq: Sequence) -> tuple[int, int]:
        return seq.priority, seq.seq_id  # (seq ids rise with arrival)

    def _queue(self, seq: Sequence, front: bool = False) -> None:
        """Into the queue: by priority under that policy; else last, or first (`front`: a
        preempted request, recomputed before those that came after it)."""
        if self.policy == "priority":  # (after the last that goes before it: from the end,
            rank = self._rank(seq)  # where a new request of the usual priority goes)
            at = len(self.waiting)
            while at and self._rank(self.waiting[at - 1]) > rank:
                at -= 1
            self.waiting.insert(at, seq)
        elif front:
            self.waiting.appendleft(seq)
        else:
            self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, num_lookahead: int = 0) -> ScheduledBatch:
        """`num_lookahead`: slots wanted after each decoding sequence's token for its draft
        tree. A sequence whose tree does not fit takes none at first; when a token does not
        fit, the trees of the sequences placed before it give way (latest first) before
        anything is preempted. Once the waiting sequences are admitted, those short of their
        tree take what the free blocks still hold (`draft_slots`: a smaller tree)."""
        seqs, num_new = [], []
        with_tree: list[Sequence] = []  # placed this step with blocks for their trees
        short: list[Sequence] = []  # decoding without their whole tree so far
        budget = self.max_num_batched_tokens
        for seq in list(self.running):
            if seq not in self.running:  # preempted below to make room for an earlier one
                continue
            n = min(seq.num_uncommitted, budget)
            if n == 0:
                continue
            extra = num_lookahead if n == seq.num_uncommitted == 1 else 0
            while not self.manager.allocate(seq.blocks, seq.blocks.length + n + extra):
                if extra:  # drafts give way first: this sequence's own tree
                    extra = 0
                    short.append(seq)
                    continue
                if with_tree:  # then the trees of those placed before it
                    other = with_tree.pop()
                    self.manager.truncate(other.blocks, other.blocks.length + 1)
                    short.append(other)
                    continue
                if self.policy == "priority":
                    victim = max(self.running, key=self._rank)
                    if victim in seqs:  # placed earlier this step: its place given back
                        k = seqs.index(victim)
                        budget += num_new.pop(k)
                        seqs.pop(k)
                        for placed in (with_tree, short):
                            if victim in placed:
                                placed.remove(victim)
                else:
                    victim = self.running[-1]
                self.preempt(victim)
                if victim is seq:
                    break
            if seq in self.running:
                seqs.append(seq)
                num_new.append(n)
                budget -= n
                if extra:
                    with_tree.append(seq)
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            found = 0
            # its first tokens may be cached already (not read where the prompt's logprobs
            # are wanted: each position needs its own forward)
            if not seq.blocks.block_table and not seq.wants_prompt_logprobs:
                found = self.manager.match(seq.blocks, seq.token_ids(0, seq.num_tokens))
            n = min(seq.num_uncommitted, budget)
            # a one-token prompt decodes (and may draft) on its first step: room for the tree
            extra = num_lookahead if n == seq.num_uncommitted == 1 else 0
            if not self.manager.allocate(seq.blocks, seq.blocks.length + n + extra):
                if not (extra and self.manager.allocate(seq.blocks, seq.blocks.length + n)):
                    self.manager.free(seq.blocks)  # what it found stays findable
                    break
                short.append(seq)
            if not seq.admitted and self.manager.prefix_caching:  # (a preempted one coming
                seq.num_cached_tokens = found  # back finds its own: not counted)
                self.manager.prefix_queries += seq.num_tokens
                self.manager.prefix_hits += found
            seq.admitted = True
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            seqs.append(seq)
            num_new.append(n)
            budget -= n
        # admissions came first; what the unused blocks still hold goes to the trees left short
        # (not the prefix cache's blocks: a smaller tree is not worth a prefix recomputed)
        free = self.manager.num_unused_blocks * self.manager.block_size
        for seq in short:
            if seq in self.running and seq.num_uncommitted == 1 and free > 0:
                blocks = seq.blocks
                room = len(blocks.block_table) * self.manager.block_size
                self.manager.allocate(blocks, min(blocks.length + 1 + num_lookahead, room + free))
                free = self.manager.num_unused_blocks * self.manager.block_size
        size = self.manager.block_size
        slots = {
            s.seq_id: min(num_lookahead, len(s.blocks.block_table) * size - s.blocks.length - 1)
            for s, n in zip(seqs, num_new, strict=True)
            if n == s.num_uncommitted == 1
        }
        return ScheduledBatch(seqs, num_new, slots)

    def reorder(self) -> None:
        """The queue back in its policy's order, after it was refilled by hand."""
        if self.policy == "priority":
            self.waiting = deque(sorted(self.waiting, key=self._rank))

    def preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.manager.free(seq.blocks)
        self.num_preemptions += 1
        for callback in self.on_preempt:
            callback(seq)
        seq.status = SequenceStatus.WAITING
        self._queue(seq, front=True)

    def finish(self, seq: Sequence) -> None:
        """Done or aborted: out of the queue or the batch, its blocks freed."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.manager.free(seq.blocks)
        seq.status = SequenceStatus.FINISHED
