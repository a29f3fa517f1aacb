"""Host torch ops of one graphed incremental mesh (``Map.mesh(since_version)``) outside the graph body,
counted on the CPU: the replay is simulated (the graph function runs with counting off and counts as one
op), so the ops a GPU host issues around the replay are what is counted (a TorchDispatchMode counter).

    TRITON_INTERPRET=1 MAPPER_KERNELS=triton python benchmarks/tools/count_mesh_host_ops.py
"""

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mapper import Map, graphs, sim


class Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0
        self.on = True
        self.names = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.on:
            self.n += 1
            k = str(func.overloadpacket)
            self.names[k] = self.names.get(k, 0) + 1
        return func(*args, **(kwargs or {}))


C = Count()
_inputs = {}


@contextlib.contextmanager
def fake_run(self, key, device, fill):
    if key not in _inputs:
        C.on = False
        _inputs[key] = self.make_inputs(key, torch.device(device))
        C.on = True
    inp = _inputs[key]
    fill(inp)
    C.n += 1  # the replay: one launch
    C.on = False
    out = tuple(self.fn(key, *inp))
    C.on = True
    yield out


graphs.GraphedOp.run = fake_run
graphs.enabled = lambda dev: True
dev = torch.device("cpu")
scene = sim.indoor_scene(0, device=dev)
cam = sim.PinholeCamera(160, 120, 131.0, 131.0, 79.5, 59.5)
poses = sim.orbit_trajectory(4, scene=scene)
m = Map(0.05, layers=("tsdf", "color"), device=dev, warmup=False)
rgb = torch.full((120, 160, 3), 128, dtype=torch.uint8)
v = m.mesh().version
for i in range(3):
    m.integrate_depth(cam.render_depth(scene, poses[i]), cam.K, poses[i], color=rgb)
    with C:
        C.n = 0
        C.names = {}
        d = m.mesh(since_version=v)
    print(flush=True)
    print(
        f"frame {i}: {C.n} host torch ops (replay = 1), delta {d.num_faces} faces; tiles built: "
        f"{m._tsdf.grid.cached_tiles is not None}; {sorted(C.names.items(), key=lambda x: -x[1])[:12]}"
    )
    with C:
        C.n = 0
        m.mesh(since_version=v)
    print(f"  again: {C.n} host torch ops")
    v = d.version
