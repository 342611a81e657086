"""Prints what a launched rank sees: ``report.py accelerator`` builds an Accelerator, ``report.py config``
only resolves the config the same way the Accelerator does (for strategies whose engine is not needed)."""
import json
import os
import sys

from impel.config import environment as env
from impel.config.run_config import merge_code_arguments

args = sys.argv[1:]
if "--touch" in args:  # proves a script started (bad-input tests assert it never does)
    open(args[args.index("--touch") + 1], "w").close()
mode = args[0] if args else "accelerator"
out = {"launched": env.read_launch_config(), "omp": os.environ.get("OMP_NUM_THREADS")}
if mode == "accelerator":
    from impel import Accelerator

    acc = Accelerator()
    out.update(rank=acc.process_index, world=acc.num_processes, distributed_type=str(acc.distributed_type),
               config=acc.config.to_dict())
    if acc.parallelism_config is not None:  # N-D parallelism: the mesh this rank built
        mesh = acc.torch_device_mesh
        out.update(mesh=list(mesh.mesh_dim_names) if mesh is not None else None, tp_rank=acc.tensor_parallel_rank)
    acc.end_training()
else:
    topo = env.read_topology()
    out.update(rank=topo.rank, world=topo.world_size, config=merge_code_arguments(env.read_launch_config(),
                                                                                  {}).to_dict())
sys.stdout.write("REPORT " + json.dumps(out) + "\n")  # one write: ranks share the pipe
sys.stdout.flush()
