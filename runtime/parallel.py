"""Tensor parallelism in the runtime: one process per rank, rank 0 the ``LLM``'s own.

Rank 0 holds the scheduler, block manager, sampler and tokenizer. It starts ranks 1..N-1 as worker
processes (torch.multiprocessing, spawn); each loads its slice of the model
(``from_pretrained(..., tensor_parallel=group)``) and builds an engine of the same options, whose
KV cache holds the rank's KV heads in as many blocks as every other rank's (the fewest any rank's
memory holds). At each step rank 0 broadcasts the step's inputs (``StepInputs``, one
``broadcast_object_list`` over a gloo group), every rank runs the same forward (eagerly, or
replaying its own CUDA graphs of the same batch sizes), the vocabulary-parallel LM head gathers the
logits on every rank, rank 0 samples, and broadcasts the sampled ids, which the next step's pending
input ids are read from on every rank (``runtime.run_ahead``). gloo on the CPU, NCCL on CUDA (rank r
on cuda:r, the metadata over a gloo group beside it).

A rank that dies takes the group down: rank 0 watches its workers' process sentinels in a thread,
and when one ends it kills the others (and aborts the NCCL communicator, so no collective waits
for the dead rank); rank 0's step then raises a RuntimeError naming the rank, its exit code and
what it reported. A step that raises on rank 0 takes the group down too, since the workers would be
left mid-step (Ctrl-C waits for the step to end). Workers exit with their parent, and
``Ranks.shutdown`` (``LLM.shutdown``, or interpreter exit) stops them.
"""

import contextlib
import os
import signal
import threading
import time
import traceback
import weakref
from datetime import timedelta
from multiprocessing import connection, parent_process

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# A worker waits this long for rank 0's next step (an idle server sends none); a dead rank is found
# through its process sentinel, never by this timeout.
IDLE_TIMEOUT = timedelta(days=30)
# After a collective fails on rank 0, how long to wait for the dead rank's process to be seen ending.
DEATH_NOTICE_S = 5.0
STOP_GRACE_S = 10.0  # a worker told to stop that has not exited by then is killed
POLL_S = 0.05
REPORT_CHARS = 16_000  # of a failed worker's traceback, sent to rank 0


def rank_device(device_type: str, rank: int) -> torch.device:
    return torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")


class Ranks:
    """One process's handle on the tensor-parallel group: its rank and size, the device group
    (gloo or NCCL) the model's collectives run over and the gloo group the steps travel over.
    On rank 0 it also holds the worker processes and watches them."""

    def __init__(self, rank: int, size: int, device: torch.device):
        self.rank, self.size, self.device = rank, size, device
        self.group = dist.group.WORLD
        # The step's inputs are host objects: on CUDA they go over gloo, not through the devices.
        self.steps_group = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT) if device.type == "cuda" else self.group
        self.failure: str | None = None  # why the group is down (rank 0)
        self.workers: list = []
        self.watch: _Watch | None = None
        self.store: dist.TCPStore | None = None  # rank 0's, which the group's rendezvous ran through

    # -- rank 0 -----------------------------------------------------------------------------

    @classmethod
    def start(cls, size: int, model: str, dtype: torch.dtype, device: torch.device, config, **load_options) -> "Ranks":
        """Start ranks 1..size-1, each loading its slice of ``model`` (``load_options``: the rest of
        ``from_pretrained``'s, ``mmap`` and ``keep_mxfp4``) with ``config``'s engine, and join them as
        rank 0. Returns once the process group is up; the workers load meanwhile."""
        if device.type == "cuda":
            if device.index not in (None, 0):
                raise ValueError(f"tensor parallelism puts rank r on cuda:r; give the device as 'cuda', not {device}")
            if torch.cuda.device_count() < size:
                raise ValueError(f"tensor_parallel_size {size} needs {size} CUDA devices; "
                                 f"{torch.cuda.device_count()} are visible")
            device = torch.device("cuda", 0)
        elif device.type != "cpu":
            raise ValueError(f"tensor parallelism runs on CUDA devices or the CPU, not {device}")
        elif size > os.cpu_count():
            raise ValueError(f"tensor_parallel_size {size} on the CPU: one process a rank, more than this machine's "
                             f"{os.cpu_count()} cores, would stall every collective")
        if dist.is_initialized():
            raise RuntimeError("tensor_parallel_size > 1 needs this process's torch.distributed default group, "
                               "which is already initialised: one tensor-parallel LLM runs in a process at a time "
                               "(shut the other down first)")
        threads = torch.get_num_threads()
        if device.type == "cuda":
            torch.cuda.set_device(device)
        else:  # the ranks share the cores: more threads than cores stall every collective
            threads = max(1, threads // size)
        store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, wait_for_workers=False, timeout=IDLE_TIMEOUT)
        context = mp.get_context("spawn")
        workers, reports = [], []
        for rank in range(1, size):
            receiver, sender = context.Pipe(duplex=False)
            process = context.Process(target=run_worker, name=f"zoo-rank{rank}", daemon=True,
                                      args=(rank, size, store.port, model, dtype, device.type, load_options,
                                            config, threads, sender))
            process.start()
            sender.close()
            workers.append(process)
            reports.append(receiver)
        watch = _Watch(workers, reports, torch.get_num_threads())
        torch.set_num_threads(threads)
        try:
            # The workers join the store before the group: a worker that dies while starting is
            # seen here, where init_process_group would wait for it.
            joined = [f"joined/{rank}" for rank in range(1, size)]
            while not store.check(joined):
                if watch.dead():
                    raise RuntimeError(f"the tensor-parallel group could not start: {watch.describe()}")
                time.sleep(POLL_S)
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=0, world_size=size,
                                    timeout=None if device.type == "cuda" else IDLE_TIMEOUT)
            ranks = cls(0, size, device)
        except BaseException:
            _end(watch, dist.group.WORLD)  # this start's group, if it got one: none was before it
            raise
        ranks.workers, ranks.store, ranks.watch = workers, store, watch
        watch.start(ranks)
        weakref.finalize(ranks, _end, watch, ranks.group)  # interpreter exit, or the LLM dropped, stops every worker
        return ranks

    def check(self) -> None:
        """Raise the reason the group is down, if it is (leaving the group first)."""
        if self.failure is not None:
            _leave(self.watch, self.group)
            raise RuntimeError(self.failure)

    @contextlib.contextmanager
    def together(self):
        """Run rank 0's part of a step, or of starting up. Where it raises, the group is taken down:
        a rank that died is named in a RuntimeError (what a collective raises when a rank is gone);
        rank 0's own error is raised as it is."""
        self.check()
        try:
            yield
        except BaseException as exc:
            # A NotImplementedError is a RuntimeError too, but never a collective's: what rank 0 cannot do,
            # the workers could not either, and their deaths of it say less than its own error.
            collective = isinstance(exc, RuntimeError) and not isinstance(exc, NotImplementedError)
            dead = collective and self.watch.wait_for_death(DEATH_NOTICE_S)
            self.take_down(self.watch.describe() if dead else f"rank 0 failed: {exc!r}")
            _leave(self.watch, self.group)
            if dead:
                raise RuntimeError(self.failure) from exc
            raise

    @contextlib.contextmanager
    def step(self):
        """Run rank 0's part of a step (``together``). Ctrl-C waits for the step to end, since
        one stopped halfway would leave the workers mid-step; a second Ctrl-C does not wait."""
        if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
            with self.together():
                yield
            return
        interrupted = []

        def after_the_step(signum, frame):
            if interrupted:
                raise KeyboardInterrupt
            interrupted.append(signum)

        previous = signal.signal(signal.SIGINT, after_the_step)
        try:
            with self.together():
                yield
        finally:
            signal.signal(signal.SIGINT, previous)
        if interrupted:
            raise KeyboardInterrupt

    def take_down(self, reason: str) -> None:
        """Stop every worker now and keep ``reason`` as the group's failure."""
        if self.failure is None:
            self.failure = f"the tensor-parallel group is down: {reason}"
        self.watch.stop()

    def shutdown(self) -> None:
        """Stop the workers (told to, then killed if they linger) and leave the group. Idempotent."""
        if self.failure is None:
            self.failure = "the tensor-parallel group is down: the LLM was shut down"
            self.watch.stopping.set()
            with contextlib.suppress(RuntimeError):  # a worker that died meanwhile is killed below
                dist.broadcast_object_list([None], src=0, group=self.steps_group)
            self.watch.stop(STOP_GRACE_S)
        else:
            self.watch.stop()
        _leave(self.watch, self.group)

    def send_step(self, step) -> None:
        dist.broadcast_object_list([step], src=0, group=self.steps_group)

    # -- every rank -------------------------------------------------------------------------

    def fewest(self, count: int) -> int:
        """The smallest ``count`` over the ranks."""
        value = torch.tensor([count], dtype=torch.long)
        dist.all_reduce(value, op=dist.ReduceOp.MIN, group=self.steps_group)
        return int(value)

    def share_sampled(self, sampled_ids: torch.Tensor) -> None:
        """Rank 0's sampled ids of a step, into the same rows of every rank's."""
        if sampled_ids.numel():
            dist.broadcast(sampled_ids, src=0, group=self.group)

    def receive_step(self):
        """The next step rank 0 sends; None when it tells the workers to stop."""
        received = [None]
        dist.broadcast_object_list(received, src=0, group=self.steps_group)
        return received[0]


class _Watch:
    """Rank 0's watch over its workers: a thread waits on their process sentinels and, when one
    ends unasked, kills the rest and takes the group down."""

    def __init__(self, workers: list, reports: list, threads: int | None):
        self.workers, self.reports = workers, reports
        self.threads = threads  # rank 0's torch threads before the ranks shared the cores, given back as it leaves
        self.stopping = threading.Event()
        self.first_death: tuple[int, int, str] | None = None  # (rank, exit code, what it reported)
        self.lock = threading.RLock()  # the workers' process state, which the watch thread and rank 0's steps read

    def start(self, ranks: Ranks) -> None:
        ranks_ref = weakref.ref(ranks)
        threading.Thread(target=self._run, args=(ranks_ref,), name="zoo-rank-watch", daemon=True).start()

    def _run(self, ranks_ref) -> None:
        ended = connection.wait([worker.sentinel for worker in self.workers])
        if self.stopping.is_set():
            return
        ranks = ranks_ref()
        with self.lock:  # rank 0 leaves the group under this lock: not while it is aborted here
            for worker in self.workers:
                if worker.sentinel in ended:
                    worker.join()  # its exit code
            if not self.dead():  # stopped meanwhile
                return
            if ranks is not None and ranks.device.type == "cuda" and _holds(ranks.group):
                # An NCCL collective would wait for the dead rank until its timeout: end it now.
                ranks.group.abort()
        if ranks is None:
            self.stop()
        else:
            ranks.take_down(self.describe())

    def dead(self) -> bool:
        """Whether a worker has ended; the first one found is kept with what it reported."""
        with self.lock:
            if self.first_death is None and not self.stopping.is_set():
                for rank, (worker, report) in enumerate(zip(self.workers, self.reports), start=1):
                    if worker.exitcode is not None:
                        self.first_death = (rank, worker.exitcode, _reported(report))
                        break
            return self.first_death is not None

    def wait_for_death(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not self.dead() and time.monotonic() < deadline:
            time.sleep(POLL_S)
        return self.dead()

    def describe(self) -> str:
        rank, exitcode, error = self.first_death
        how = f"was killed by signal {-exitcode}" if exitcode < 0 else f"exited with code {exitcode}"
        message = f"tensor-parallel rank {rank} {how}"
        return f"{message}; it reported:\n{error}" if error else message

    def stop(self, grace: float = 0.0) -> None:
        """End every worker: those still running after ``grace`` seconds are killed."""
        self.stopping.set()
        deadline = time.monotonic() + grace
        with self.lock:
            for worker in self.workers:
                worker.join(max(0.0, deadline - time.monotonic()))
            for worker in self.workers:
                if worker.is_alive():
                    worker.kill()
            for worker in self.workers:
                worker.join()


def _reported(report) -> str:
    """What a worker that ended sent before it did; nothing if it was killed."""
    try:
        return report.recv() if report.poll() else ""
    except EOFError:
        return ""


def _holds(group) -> bool:
    """Whether the default process group is still ``group`` (a later LLM may have its own)."""
    return dist.is_initialized() and dist.group.WORLD is group


def _leave(watch: _Watch, group) -> None:
    """Destroy ``group``, where still this process's default (under the watch's lock: not while
    the watch aborts it), and give rank 0 back its threads."""
    with watch.lock:
        if _holds(group):
            dist.destroy_process_group()
        if watch.threads is not None:
            torch.set_num_threads(watch.threads)
            watch.threads = None


def _end(watch: _Watch, group) -> None:
    watch.stop()
    _leave(watch, group)


# -- the workers ---------------------------------------------------------------------------------


def run_worker(rank, size, port, model, dtype, device_type, load_options, config, threads, report) -> None:
    """A worker rank's process: join the group, load the rank's slice of ``model``, build its
    engine, then run every step rank 0 sends until told to stop. An error is sent to rank 0
    through ``report`` before the process exits."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is rank 0's to handle
    threading.Thread(target=_exit_with_parent, name="zoo-parent-watch", daemon=True).start()
    try:
        torch.set_num_threads(threads)
        device = rank_device(device_type, rank)
        if device.type == "cuda":  # before anything touches the device
            torch.cuda.set_device(device)
        from models import AutoModelForCausalLM
        from runtime.engine import Engine, start_up_objects_frozen

        store = dist.TCPStore("127.0.0.1", port, size, is_master=False, timeout=IDLE_TIMEOUT)
        store.set(f"joined/{rank}", "1")
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=rank, world_size=size,
                                timeout=None if device.type == "cuda" else IDLE_TIMEOUT)
        ranks = Ranks(rank, size, device)
        loaded = AutoModelForCausalLM.from_pretrained(model, dtype=dtype, device=device, tensor_parallel=ranks.group,
                                                      **load_options)
        with torch.inference_mode(False):  # as LLM builds its engine: buffers written outside inference mode
            engine = Engine(loaded, None, [], config, ranks=ranks)
        with start_up_objects_frozen():
            while (step := ranks.receive_step()) is not None:
                engine.runner.forward(step)
                ranks.share_sampled(engine.run_ahead.sampled_ids[: len(step.logits_rows)])
        dist.destroy_process_group()
    except BaseException:
        # Its end, where the error is: rank 0 reads the pipe only once this process has ended, so
        # what is sent must fit the pipe's buffer (64 KiB on Linux).
        report.send(traceback.format_exc()[-REPORT_CHARS:])
        report.close()
        os._exit(1)  # not through the interpreter's exit, which may wait on the group's threads


def _exit_with_parent() -> None:
    connection.wait([parent_process().sentinel])
    os._exit(1)
