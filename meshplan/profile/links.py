"""Links between devices when only one is profiled (``meshplan profile --nproc 1``, ``--cluster local``).

With one device there is no collective to time, so the intra-node latency and bandwidth are
derived, each from a named source, and the profile marks them so (``provenance``):

- CPU: a TCP ping-pong over the loopback interface between two threads of this process
  (``loopback_points``): gloo's transport between processes on one host, without gloo's
  collective algorithm or a second process; fitted like ``meshplan profile``'s send/recv;
- a GPU that matches a preset (H100, H200, A100, V100): that preset's NVLink and InfiniBand
  figures (datasheet, ``cost_models.hardware.PRESETS``);
- another GPU: host<->device copies of pinned memory (``bus_points``), i.e. the PCIe link a
  transfer between two such GPUs without NVLink crosses, fitted as a send/recv.

torch is imported inside the functions only.
"""

from __future__ import annotations

import socket
import statistics
import threading
import time
from collections.abc import Sequence
from typing import Any

from meshplan.cost_models.hardware import ClusterSpec, preset_for_gpu_name
from meshplan.profile.budget import Log
from meshplan.profile.comm import fit_or_bound

#: message sizes of the single-device link measurements (4 KiB .. 4 MiB)
LINK_SIZES = (4096, 65536, 1 << 20, 4 << 20)
#: seconds one loopback send or receive may block
LOOPBACK_TIMEOUT_S = 10.0


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if not n:
            raise ConnectionError("loopback peer closed the connection")
        got += n


def loopback_points(sizes: Sequence[int], reps: int, deadline: float | None = None) -> list[tuple[int, float]]:
    """(bytes, seconds) of a one-way TCP loopback transfer (median half round trip) per size.

    An echo thread sends back each message (an 8-byte length, then the bytes); sizes after the
    first are skipped once ``deadline`` (``time.monotonic()``) has passed."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    srv.settimeout(LOOPBACK_TIMEOUT_S)
    cli = socket.create_connection(srv.getsockname(), timeout=LOOPBACK_TIMEOUT_S)
    peer, _ = srv.accept()
    for s in (cli, peer):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.settimeout(LOOPBACK_TIMEOUT_S)  # a stuck transfer raises instead of hanging the profile

    def echo() -> None:
        head = memoryview(bytearray(8))
        try:
            while True:
                _recv_exact(peer, head)
                n = int.from_bytes(head, "little")
                if not n:
                    return
                buf = memoryview(bytearray(n))
                _recv_exact(peer, buf)
                peer.sendall(buf)
        except OSError:
            return

    out: list[tuple[int, float]] = []
    th = threading.Thread(target=echo, daemon=True)
    th.start()
    try:
        for i, n in enumerate(sizes):
            if i and deadline is not None and time.monotonic() > deadline:
                break
            buf = memoryview(bytearray(n))
            head = n.to_bytes(8, "little")
            times = []
            for j in range(reps + 1):
                t0 = time.perf_counter()
                cli.sendall(head)
                cli.sendall(buf)
                _recv_exact(cli, buf)
                if j:  # the first round trip sets up buffers
                    times.append((time.perf_counter() - t0) / 2)
            out.append((n, statistics.median(times)))
        cli.sendall((0).to_bytes(8, "little"))
    finally:
        th.join(timeout=5)
        for s in (cli, peer, srv):
            s.close()
    return out


def bus_points(device: Any, sizes: Sequence[int], reps: int, deadline: float | None = None) -> list[tuple[int, float]]:
    """(bytes, seconds) of a pinned host -> ``device`` copy per size (median, synchronized)."""
    import torch

    out = []
    for i, n in enumerate(sizes):
        if i and deadline is not None and time.monotonic() > deadline:
            break
        host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(n, dtype=torch.uint8, device=device)
        times = []
        for j in range(reps + 1):
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            dev.copy_(host, non_blocking=True)
            torch.cuda.synchronize(device)
            if j:
                times.append(time.perf_counter() - t0)
        out.append((n, statistics.median(times)))
    return out


def single_device_links(
    device: Any, dev_name: str, reps: int, log: Log, deadline: float | None = None, mem_bw: float | None = None
) -> tuple[dict[str, float], dict[str, str]]:
    """Intra/inter-node latency and bandwidth for a one-device profile, and their provenance
    (every entry "derived: ..."). Returns (figures by ClusterSpec field, provenance by field).
    When the loopback cannot be measured (no TCP on 127.0.0.1) and ``mem_bw`` (the measured copy
    bandwidth) is given, the bandwidth is half of it (a byte moved between processes is read
    and written once) and the latency 0 (unknown), both marked so."""
    figures: dict[str, float] = {}
    if device.type == "cuda" and (preset := preset_for_gpu_name(dev_name)):
        ref = ClusterSpec.preset(preset)
        figures = {"intra_latency_s": ref.intra_latency_s, "intra_bw_bytes_per_s": ref.intra_bw_bytes_per_s,
                   "inter_latency_s": ref.inter_latency_s, "inter_bw_bytes_per_s": ref.inter_bw_bytes_per_s}
        why = {k: f"derived: the {preset} preset's {'NVLink' if k.startswith('intra') else 'InfiniBand'} figure "
                  f"({ref.source}); one device, no collective measured" for k in figures}  # fmt: skip
        log(f"one device ({dev_name}): links between devices taken from the {preset} preset (not measured)")
        return figures, why
    if device.type == "cuda":
        pts = bus_points(device, LINK_SIZES, reps, deadline)
        how = "pinned host->device copies (the PCIe bus a transfer between two such GPUs crosses)"
    else:
        try:
            pts = loopback_points(LINK_SIZES, reps, deadline)
        except OSError as e:
            if mem_bw is None:
                raise
            log(f"one device: TCP loopback not measurable ({e}); links derived from the memory bandwidth")
            figures = {"intra_latency_s": 0.0, "intra_bw_bytes_per_s": mem_bw / 2, "inter_latency_s": 0.0,
                       "inter_bw_bytes_per_s": mem_bw / 2}  # fmt: skip
            why = {k: ("derived: one device, no collective; half the measured copy bandwidth (a byte moved between "
                       "processes is read and written once), an upper bound" if k.endswith("bw_bytes_per_s") else
                       "derived: one device, no collective; 0, not measurable here (TCP loopback failed)")
                   for k in figures}  # fmt: skip
            return figures, why
        how = "a TCP loopback ping-pong between two threads (gloo's transport between processes on one host)"
    _, bw = fit_or_bound(pts, "send_recv", 2, log)
    n0, t0 = min(pts)
    alpha = max(0.0, t0 - n0 / bw)  # the smallest message is latency bound
    log(f"one device: links derived from {how.split(' (')[0]} (not measured collectives): alpha {alpha * 1e6:.1f} us, bw {bw / 1e9:.3f} GB/s")
    figures = {"intra_latency_s": alpha, "intra_bw_bytes_per_s": bw, "inter_latency_s": alpha, "inter_bw_bytes_per_s": bw}
    sizes = f"{pts[0][0]}-{pts[-1][0]} B"
    why = {k: f"derived: one device, no collective; {how}, {sizes}"
           + (", slope" if k.endswith("bw_bytes_per_s") else ", smallest size less its transfer time")
           + ("" if k.startswith("intra") else "; between nodes = within") for k in figures}  # fmt: skip
    return figures, why
