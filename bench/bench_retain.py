"""Installing a merged worker's retained prefixes: in place against through the leader (prints
figures; not a test).

    .venv/bin/python bench/bench_retain.py [chains] [blocks]

A torch world of 2 rank processes (gloo, 1 thread each, a random Qwen3 with 1 MiB pages:
8 layers, 4 KV heads of 64, 64-token blocks, float32) runs two CP1 workers; both prefill the
same ``chains`` prompts of ``blocks`` full blocks, then the ranks merge into one CP2 worker.
Every page of those prompts is then retained by the merge (page p sits on rank p mod 2 in
both geometries), and the merged worker installs them two ways, from the same empty cache:

* **through the leader** (``TorchWorld.copy_prefix`` per chain, left predecessor first: what
  ``TorchBackend.inherit_prefixes`` did before 2026-12-02): each chain's pages are exported to
  the leader, and each member is sent the pages it keeps (its rank's share);
* **in place** (``TorchWorld.adopt_resident`` per chain: what it does now): two small rounds
  per chain, the members share the slots their rank's page pool already holds.

Reports each path's wall time, pages and bytes moved through the leader, and checks that both
end with the same cached set. One run each, in one process (quote the ratio).
"""

from __future__ import annotations

import sys
import time

from services.rankd.torch_backend import TINY_MODEL
from services.rankd.torch_world import TorchWorld, WorldSpec
from shared.blockhash import chain_hashes

BLOCK = 64
CFG = {**TINY_MODEL, "vocab_size": 256, "hidden_size": 256, "intermediate_size": 512,
       "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 4,
       "head_dim": 64, "max_position_embeddings": 8192}
PAGE_BYTES = CFG["num_hidden_layers"] * 2 * BLOCK * CFG["num_key_value_heads"] \
    * CFG["head_dim"] * 4


def prompt(i: int, blocks: int) -> list[int]:
    return [(i * 7919 + t * 31) % 256 for t in range(blocks * BLOCK + 1)]


def main(chains: int = 32, blocks: int = 8) -> None:
    spec = WorldSpec(2, (1, 2), (1, 1), model_config=CFG, block_size=BLOCK,
                     pages_per_rank=2 * chains * blocks)
    with TorchWorld(spec) as w:
        ids = [prompt(i, blocks) for i in range(chains)]
        for rank in (0, 1):
            for p in ids:
                w.prefill([rank], p)
        w.switch([0, 1], 1, 2)
        pairs = []
        for p in ids:
            hs = chain_hashes(p, BLOCK)
            pairs.append(list(zip(hs, [None, *hs[:-1]], strict=True)))
        want = {h for c in pairs for h, _ in c}

        t = time.perf_counter()
        for c in pairs:
            hs = [h for h, _ in c]
            for src, ranks in (("w-cp1-g0", [0]), ("w-cp1-g1", [1])):
                if set(hs) <= w.cached_blocks("w-cp2-g0"):
                    break
                w.copy_prefix(ranks, src, [0, 1], hs)
        copy_s = time.perf_counter() - t
        copied = w.copied_pages
        sent_bytes = sum(w.kv_bytes_sent)
        assert w.cached_blocks("w-cp2-g0") == want
        w.remove([0, 1], sorted(want))

        t = time.perf_counter()
        for c in pairs:
            w.adopt_resident([0, 1], c)
        place_s = time.perf_counter() - t
        assert w.cached_blocks("w-cp2-g0") == want and w.copied_pages == copied
        adopted = w.adopted_pages

    n = chains * blocks
    mib = PAGE_BYTES / 2**20
    # copy_prefix sends each member only the pages it keeps (page p to rank p mod 2); the
    # world counts what it sent (CPU tensors cross the pipes as shared-memory handles).
    print(f"{chains} chains x {blocks} blocks = {n} retained pages of {mib:.2f} MiB")
    print(f"  through the leader: {copy_s:8.3f} s, {copied} pages installed, "
          f"{copied * mib:.0f} MiB exported to the leader, {sent_bytes / 2**20:.0f} MiB sent "
          "to the members")
    print(f"  in place:           {place_s:8.3f} s, {adopted} pages shared, 0 MiB sent")
    print(f"  ratio: {copy_s / place_s:.1f}x")


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:3]))
