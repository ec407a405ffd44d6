"""An sbatch script that runs a plan on a Slurm allocation: one ``meshplan run`` per node.

The script asks for ``--nodes N`` with one task per node, takes the rendezvous host from the
first host of ``$SLURM_JOB_NODELIST`` (``scontrol show hostnames``), and ``srun`` starts the same
``meshplan run ... --nnodes N --nproc-per-node P --node-rank $SLURM_NODEID --rdzv-endpoint
HEAD:PORT --rdzv-id $SLURM_JOB_ID`` on every node (torchrun's c10d rendezvous, which numbers ranks
in join order). It runs from the directory it was written in, so relative paths (plan, data,
checkpoints) mean what they meant there. Text only: nothing is submitted, torch is not imported.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence

DEFAULT_PORT = 29500


def sbatch_script(run_argv: Sequence[str], *, nnodes: int, nproc_per_node: int, workdir: str,
                  job_name: str = "meshplan", partition: str | None = None, time: str | None = None,
                  gpus_per_node: int | None = None, port: int = DEFAULT_PORT) -> str:
    """The script text. ``run_argv``: the ``meshplan run`` argv every node runs (launch flags are added)."""
    if nnodes < 1 or nproc_per_node < 1:
        raise ValueError(f"a Slurm job needs nnodes >= 1 and nproc-per-node >= 1, got {nnodes} x {nproc_per_node}")
    head = [
        "#!/bin/bash",
        f"#SBATCH --job-name={job_name}",
        f"#SBATCH --nodes={nnodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --cpus-per-task={max(1, nproc_per_node)}",
    ]
    if gpus_per_node:
        head.append(f"#SBATCH --gpus-per-node={gpus_per_node}")
    if partition:
        head.append(f"#SBATCH --partition={partition}")
    if time:
        head.append(f"#SBATCH --time={time}")
    head.append("#SBATCH --output=%x-%j.out")
    node_cmd = shlex.join([*run_argv, "--nnodes", str(nnodes), "--nproc-per-node", str(nproc_per_node)])
    node_cmd += ' --node-rank "$SLURM_NODEID" --rdzv-endpoint "$MESHPLAN_RDZV_ENDPOINT" --rdzv-id "$SLURM_JOB_ID"'
    body = [
        "",
        "set -euo pipefail",
        f"cd {shlex.quote(workdir)}",
        "# rendezvous on the first node of the allocation (torchrun c10d; ranks follow join order)",
        'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        f'export MESHPLAN_RDZV_ENDPOINT="$head_node:${{MESHPLAN_RDZV_PORT:-{port}}}"',
        'echo "meshplan: $SLURM_JOB_NUM_NODES nodes, rendezvous at $MESHPLAN_RDZV_ENDPOINT"',
        f"srun --nodes={nnodes} --ntasks-per-node=1 --kill-on-bad-exit=1 bash -c {shlex.quote('exec ' + node_cmd)}",
        "",
    ]
    return "\n".join(head + body)
