"""GPU debugging aid: Triton vs torch dilation, iteration by iteration, dumping the first difference."""

import numpy as np
import torch

from mapper import IndexGrid
from mapper.kernels import morphology, triton_ops
from mapper.kernels.keys import decode_leaf_keys


def torch_spill(leaves, tiles, conn):
    tile_of = torch.repeat_interleave(
        torch.arange(tiles.keys.numel(), device=leaves.keys.device), tiles.starts.diff()
    )
    S = torch.zeros((tiles.keys.numel(), 27), dtype=torch.int64, device=leaves.keys.device)
    pos = leaves.keys & 63
    for d in morphology.stencil_directions(conn):
        di = (d[0] + 1) * 9 + (d[1] + 1) * 3 + (d[2] + 1)
        f = morphology.spill_flags(leaves.masks, d)
        S[:, di].scatter_add_(0, tile_of[f], torch.ones_like(pos[f]) << pos[f])
    return S


def main():
    rng = np.random.default_rng(0)
    bad = 0
    for trial in range(30):
        n = int(rng.integers(50, 3000))
        lo, hi = -int(rng.integers(8, 80)), int(rng.integers(8, 80))
        pts = torch.from_numpy(rng.integers(lo, hi, size=(n, 3))).cuda()
        for conn in (6, 18, 26):
            g = IndexGrid.from_ijk(pts)
            for it in range(3):
                lv, tl_ = triton_ops.dilate_triton(g.leaves, g.tiles, conn)
                ref = morphology.dilate_torch(g.leaves, conn)
                ok = (
                    lv.keys.shape == ref.keys.shape
                    and torch.equal(lv.keys, ref.keys)
                    and torch.equal(lv.masks, ref.masks)
                )
                if not ok:
                    bad += 1
                    print(
                        f"trial {trial} conn {conn} iter {it}: leaves triton {lv.keys.numel()} "
                        f"torch {ref.keys.numel()}"
                    )
                    S_tr = torch.zeros((g.tiles.keys.numel(), 27), dtype=torch.int64, device="cuda")
                    need = torch.empty(g.tiles.keys.numel(), dtype=torch.int32, device="cuda")
                    triton_ops._spill_kernel[(g.tiles.keys.numel(),)](
                        g.tiles.masks, g.tiles.starts, g.leaves.masks, S_tr, need, MAXN=triton_ops._MAXN[conn]
                    )
                    S_ref = torch_spill(g.leaves, g.tiles, conn)
                    print(
                        "  spill S equal:",
                        torch.equal(S_tr, S_ref),
                        "diff entries:",
                        int((S_tr != S_ref).sum()),
                    )
                    print("  need bits:", need[:8].tolist())
                    if not torch.equal(S_tr, S_ref):
                        idx = (S_tr != S_ref).nonzero()[:5]
                        for t, d in idx.tolist():
                            print(
                                f"   tile {t} d {d}: triton {S_tr[t, d].item():#x} "
                                f"ref {S_ref[t, d].item():#x}"
                            )
                    ks = set(lv.keys.tolist())
                    kr = set(ref.keys.tolist())
                    print("  missing leaves:", len(kr - ks), "extra:", len(ks - kr))
                    common = torch.tensor(sorted(ks & kr), device="cuda")
                    if common.numel():
                        a = lv.masks[torch.searchsorted(lv.keys, common)]
                        b = ref.masks[torch.searchsorted(ref.keys, common)]
                        diff = (a != b).any(1)
                        print("  leaves with different masks:", int(diff.sum()))
                        for k in common[diff][:3].tolist():
                            c = decode_leaf_keys(torch.tensor([k])).tolist()[0]
                            ia = int(torch.searchsorted(lv.keys, torch.tensor(k, device="cuda")))
                            ib = int(torch.searchsorted(ref.keys, torch.tensor(k, device="cuda")))
                            xa = lv.masks[ia].tolist()
                            xb = ref.masks[ib].tolist()
                            print(
                                f"   leaf {c} pos {k & 63}: words differing",
                                [
                                    (w, hex(xa[w] & (2**64 - 1)), hex(xb[w] & (2**64 - 1)))
                                    for w in range(8)
                                    if xa[w] != xb[w]
                                ],
                            )
                    break
                g = IndexGrid(ref)
            if bad > 3:
                return
    print("bad cases:", bad)


if __name__ == "__main__":
    main()
