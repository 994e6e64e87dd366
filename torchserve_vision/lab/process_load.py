"""A closed-loop load generator that runs as several processes, for rates one Python process
cannot send (a GPU serving thousands of images a second), and a trivial responder to measure it.

Each process runs its share of the clients as asyncio coroutines over raw HTTP/1.1 keep-alive
connections (no per-request objects beyond the bytes: the generator is a measuring instrument),
cycling through the bodies from its own offset, so the whole set is sent in turn. The processes
start together, measure the same window after a warm-up, and send back their latencies, which
are summarised as one `loadgen.Report`. The responder (`trivial_responder`) is asyncio too, one
process per core share on one port (SO_REUSEPORT): it reads each request and answers `[]` at
once, and is not TorchServe, so the generator's own ceiling is what it measures.

    torchserve-vision lab gpu      # uses both (lab/gpu_lab.py)
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import pickle
import socket
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from urllib.parse import urlparse

from torchserve_vision.lab.loadgen import Report, Result, summarize
from torchserve_vision.torchserve_config import free_ports

CONTEXT = multiprocessing.get_context("spawn")
HEADER_END = b"\r\n\r\n"


@dataclass(frozen=True)
class LoadPlan:
    """What every process of one run is told: where to send, which bodies (a pickled list in
    `bodies_file`), how many clients in all, and the run's timing (seconds after `start_at`, a
    time.time() shared by all processes)."""

    url: str
    bodies_file: str
    clients: int
    processes: int
    start_at: float
    warm_up_s: float
    duration_s: float
    headers: tuple[tuple[str, str], ...] = (("Content-Type", "application/octet-stream"),)


def request_head(plan: LoadPlan, length: int) -> bytes:
    parsed = urlparse(plan.url)
    lines = [f"POST {parsed.path or '/'} HTTP/1.1", f"Host: {parsed.netloc}",
             f"Content-Length: {length}", *(f"{name}: {value}" for name, value in plan.headers)]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


async def read_answer(reader: asyncio.StreamReader) -> int:
    """One HTTP/1.1 answer read whole (Content-Length or chunked); its status."""
    head = await reader.readuntil(HEADER_END)
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    status = int(status_line.split(" ", 2)[1])
    fields = {name.strip().lower(): value.strip() for name, _, value in
              (line.partition(":") for line in header_lines if line)}
    if "content-length" in fields:
        await reader.readexactly(int(fields["content-length"]))
    elif fields.get("transfer-encoding", "").lower() == "chunked":
        while size := int((await reader.readline()).split(b";")[0], 16):
            await reader.readexactly(size + 2)
        await reader.readline()
    return status


async def one_client(plan: LoadPlan, bodies: Sequence[bytes], first: int, step: int,
                     results: list[Result]) -> None:
    """Send back to back until the window closes; record the requests sent inside it."""
    parsed = urlparse(plan.url)
    heads = {len(body): request_head(plan, len(body)) for body in bodies}
    measure_from, stop_at = plan.start_at + plan.warm_up_s, plan.start_at + plan.warm_up_s + plan.duration_s
    reader = writer = None
    index = first
    while (now := time.time()) < stop_at:
        body = bodies[index % len(bodies)]
        index += step
        try:
            if writer is None:
                reader, writer = await asyncio.open_connection(parsed.hostname, parsed.port)
                writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            assert reader is not None
            writer.writelines((heads[len(body)], body))
            status = await read_answer(reader)
        except (OSError, asyncio.IncompleteReadError, ValueError):
            status = 0
            if writer is not None:
                writer.close()
            reader = writer = None
        if now >= measure_from:
            results.append(Result(now - measure_from, (time.time() - now) * 1000, status))
    if writer is not None:
        writer.close()


def run_share(plan: LoadPlan, share: int, answer: Connection) -> None:
    """One process's clients: client k of the run is in process k % processes."""
    bodies: list[bytes] = pickle.loads(Path(plan.bodies_file).read_bytes())
    clients = range(share, plan.clients, plan.processes)
    results: list[Result] = []

    async def all_clients() -> None:
        await asyncio.sleep(max(0.0, plan.start_at - time.time()))
        await asyncio.gather(*(one_client(plan, bodies, client, plan.clients, results)
                               for client in clients))

    asyncio.run(all_clients())
    answer.send(results)
    answer.close()


def run_processes(url: str, bodies: Sequence[bytes], clients: int, processes: int,
                  duration_s: float, warm_up_s: float = 2.0, work_dir: Path | None = None) -> Report:
    """`clients` closed-loop clients over `processes` processes (at most one per client) for
    `duration_s` measured seconds after `warm_up_s`; one Report of all their requests."""
    processes = max(1, min(processes, clients))
    with contextlib.ExitStack() as stack:
        directory = work_dir or Path(stack.enter_context(_temporary_directory()))
        bodies_file = directory / "load-bodies.pickle"
        if not bodies_file.is_file():
            bodies_file.write_bytes(pickle.dumps(list(bodies)))
        plan = LoadPlan(url, str(bodies_file), clients, processes, time.time() + 1.5 + 0.05 * processes,
                        warm_up_s, duration_s)
        pipes, workers = [], []
        for share in range(processes):
            receive, send = CONTEXT.Pipe(duplex=False)
            worker = CONTEXT.Process(target=run_share, args=(plan, share, send), daemon=True)
            worker.start()
            send.close()
            pipes.append(receive)
            workers.append(worker)
        results = [result for pipe in pipes for result in pipe.recv()]
        for worker in workers:
            worker.join()
    report = summarize("closed loop", results, duration_s)
    report.extra.update(clients=clients, processes=processes)
    return report


@contextlib.contextmanager
def _temporary_directory() -> Iterator[str]:
    import tempfile

    with tempfile.TemporaryDirectory() as directory:
        yield directory


# --- the trivial responder ------------------------------------------------------------------------
ANSWER = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n[]"


async def _answer_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            head = await reader.readuntil(HEADER_END)
            length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), 0)
            await reader.readexactly(length)
            writer.write(ANSWER)
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


def _respond_forever(port: int) -> None:
    async def serve() -> None:
        server = await asyncio.start_server(_answer_connection, "127.0.0.1", port, reuse_port=True,
                                            backlog=4096)
        async with server:
            await server.serve_forever()

    asyncio.run(serve())


@contextlib.contextmanager
def trivial_responder(processes: int) -> Iterator[str]:
    """A URL answered by `processes` asyncio processes that reply `[]` to every POST at once."""
    port = free_ports(1)[0]
    workers = [CONTEXT.Process(target=_respond_forever, args=(port,), daemon=True)
               for _ in range(max(1, processes))]
    for worker in workers:
        worker.start()
    try:
        _wait_listening(port)
        yield f"http://127.0.0.1:{port}/predictions/trivial"
    finally:
        for worker in workers:
            worker.terminate()
            worker.join()


def _wait_listening(port: int, timeout_s: float = 30.0) -> None:
    from torchserve_vision.waiting import wait_until

    def accepting() -> bool:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
        return False

    wait_until(accepting, timeout_s, f"the trivial responder on port {port}")


def default_processes() -> int:
    """Half the cores (the server gets the other half), at least one."""
    return max(1, (os.cpu_count() or 2) // 2)
