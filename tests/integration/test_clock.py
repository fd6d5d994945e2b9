"""A clock jump on one instance's host, injected for real into that instance's processes, judged by the
oracle and by the control log (nobody declared dead).

Event time is data time (the generator's timestamps), so a host's wall clock must change nothing in the
output; the timers that run on processing time (the controller's heartbeat and progress timeouts, the
statistics windows of its policy) must not misfire either.

The fault is a step of CLOCK_REALTIME on one host, which is what an NTP step does: the wall clock moves,
the monotonic clock does not, and a wait until a wall-clock deadline still ends when the (stepped) wall
clock reaches it. `CLOCKSTEP` is preloaded into one instance process (its JVM and Python workers inherit
it): every read of the wall clock is shifted by the seconds in a file the test rewrites while the
instance runs, and every deadline on the wall clock is moved back onto the host's, on which the kernel
waits. It is built with the system's C compiler (`gcc` and `libc6-dev`, installed by
`scripts/ensure-docker.sh`).

Debian's libfaketime (0.9.10) cannot stand in for it: with the monotonic clock left alone
(`FAKETIME_DONT_FAKE_MONOTONIC=1`) every `time.sleep` of Python failed with EINVAL, and it does not
translate the deadlines of C11's `cnd_timedwait`, on which librdkafka waits: an hour behind, a metadata
request of 10 s failed with `_TIMED_OUT` after 70 s; an hour ahead, it had not ended after 100 s.

A step back would stop the instance's batches for its length (Spark's trigger waits until a wall-clock
time): the instance notices it and starts its query again (decision 0054).
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from bench.soak import Watch, moved
from controller.moves.kafka_mover import request_moves
from generator.producer import run_generator
from local.processes import LocalPipeline
from pipeline.oracle import verify_pipeline
from pipeline.protocol import Mode
from pipeline.topics import read_topic
from tests.integration.test_faults import drained_and_nobody_evicted
from tests.integration.test_pipeline import small_config

INSTANCES = ["instance-0", "instance-1"]
SKEWED = "instance-1"
OFFSET_S = 3600  # how far behind the skewed host's clock runs until it is stepped
HEARTBEAT_TIMEOUT_S = 10

CLOCKSTEP = r"""
/* The host's wall clock shifted by the seconds in the file $CLOCKSTEP_FILE ("-3600", "0"), read again
   at most every 100 ms: a step of CLOCK_REALTIME on one host. Reads of the wall clock are shifted;
   deadlines on it are moved back onto the host's, on which the kernel waits. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <pthread.h>
#include <semaphore.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <sys/time.h>
#include <threads.h>
#include <time.h>
#include <unistd.h>

#define NS 1000000000LL
#define REREAD_NS 100000000LL

static atomic_llong shift_ns;
static atomic_llong read_at_ns = -REREAD_NS - 1;

static int (*next_clock_gettime)(clockid_t, struct timespec *);

static long long ns_of(const struct timespec *ts) { return (long long)ts->tv_sec * NS + ts->tv_nsec; }

static struct timespec ts_of(long long ns) {
    struct timespec ts = {ns / NS, ns % NS};
    if (ts.tv_nsec < 0) {
        ts.tv_sec -= 1;
        ts.tv_nsec += NS;
    }
    return ts;
}

static long long shift(void) {
    if (!next_clock_gettime) next_clock_gettime = dlsym(RTLD_NEXT, "clock_gettime");
    struct timespec now;
    next_clock_gettime(CLOCK_MONOTONIC, &now);
    long long at = ns_of(&now), last = atomic_load(&read_at_ns);
    if (at - last > REREAD_NS && atomic_compare_exchange_strong(&read_at_ns, &last, at)) {
        const char *path = getenv("CLOCKSTEP_FILE");
        int fd = path ? open(path, O_RDONLY | O_CLOEXEC) : -1;
        if (fd >= 0) {
            char text[64];
            ssize_t n = read(fd, text, sizeof text - 1);
            close(fd);
            if (n > 0) {
                text[n] = 0;
                atomic_store(&shift_ns, (long long)(strtod(text, NULL) * NS));
            }
        }
    }
    return atomic_load(&shift_ns);
}

static int realtime(clockid_t id) { return id == CLOCK_REALTIME || id == CLOCK_REALTIME_COARSE; }

/* reads of the wall clock */

int clock_gettime(clockid_t id, struct timespec *ts) {
    long long s = shift();
    int r = next_clock_gettime(id, ts);
    if (r == 0 && realtime(id)) *ts = ts_of(ns_of(ts) + s);
    return r;
}

int gettimeofday(struct timeval *restrict tv, void *restrict tz) {
    (void)tz;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    tv->tv_sec = ts.tv_sec;  /* never NULL: glibc declares it nonnull */
    tv->tv_usec = ts.tv_nsec / 1000;
    return 0;
}

time_t time(time_t *t) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    if (t) *t = ts.tv_sec;
    return ts.tv_sec;
}

int timespec_get(struct timespec *ts, int base) {
    return base == TIME_UTC && clock_gettime(CLOCK_REALTIME, ts) == 0 ? base : 0;
}

/* deadlines on the wall clock: the kernel waits on the host's */

static struct timespec on_host(const struct timespec *deadline) { return ts_of(ns_of(deadline) - shift()); }

#define NEXT(name) static __typeof__(name) *next; if (!next) next = dlsym(RTLD_NEXT, #name)

int cnd_timedwait(cnd_t *restrict c, mtx_t *restrict m, const struct timespec *restrict deadline) {
    NEXT(cnd_timedwait);
    struct timespec d = on_host(deadline);
    return next(c, m, &d);
}

int pthread_cond_timedwait(pthread_cond_t *restrict c, pthread_mutex_t *restrict m,
                           const struct timespec *restrict deadline) {
    NEXT(pthread_cond_timedwait);
    /* glibc keeps the condition's clock in bit 1 of __wrefs (1: CLOCK_MONOTONIC) */
    if (c->__data.__wrefs & 2) return next(c, m, deadline);
    struct timespec d = on_host(deadline);
    return next(c, m, &d);
}

int pthread_cond_clockwait(pthread_cond_t *restrict c, pthread_mutex_t *restrict m, clockid_t id,
                           const struct timespec *restrict deadline) {
    NEXT(pthread_cond_clockwait);
    struct timespec d = realtime(id) ? on_host(deadline) : *deadline;
    return next(c, m, id, &d);
}

int clock_nanosleep(clockid_t id, int flags, const struct timespec *request, struct timespec *remain) {
    NEXT(clock_nanosleep);
    struct timespec d = realtime(id) && (flags & TIMER_ABSTIME) ? on_host(request) : *request;
    return next(id, flags, &d, remain);
}

int sem_timedwait(sem_t *restrict s, const struct timespec *restrict deadline) {
    NEXT(sem_timedwait);
    struct timespec d = on_host(deadline);
    return next(s, &d);
}

int pthread_mutex_timedlock(pthread_mutex_t *restrict m, const struct timespec *restrict deadline) {
    NEXT(pthread_mutex_timedlock);
    struct timespec d = on_host(deadline);
    return next(m, &d);
}
"""


def _clockstep(work: Path) -> Path:
    """`CLOCKSTEP` compiled into `work`; a missing compiler fails the test (never a skip)."""
    source, library = work / "clockstep.c", work / "clockstep.so"
    source.write_text(CLOCKSTEP)
    command = ["cc", "-O2", "-Wall", "-shared", "-fPIC", "-o", str(library), str(source), "-ldl"]
    try:
        built = subprocess.run(command, capture_output=True, text=True)
    except FileNotFoundError:
        raise AssertionError(
            "no C compiler (cc): install gcc and libc6-dev (scripts/ensure-docker.sh)"
        ) from None
    assert built.returncode == 0, f"cannot build the clock step library: {built.stderr}"
    return library


def _clock_env(offset_file: Path, work: Path) -> dict[str, str]:
    """An environment whose processes see this host's wall clock shifted by what `offset_file` says."""
    return {"LD_PRELOAD": str(_clockstep(work)), "CLOCKSTEP_FILE": str(offset_file)}


def _skews_s(records: list[dict[str, Any]]) -> list[float]:
    """For each heartbeat of the skewed instance, how far its wall clock was behind the other
    instance's, by the newest heartbeat of that one before it in the metrics log (a second apart)."""
    skews: list[float] = []
    other: dict[str, Any] | None = None
    for r in records:
        if r.get("kind") != "heartbeat":
            continue
        if r["instance"] != SKEWED:
            other = r
        elif other is not None:
            skews.append((other["time_ms"] - r["time_ms"]) / 1000)
    return skews


@pytest.mark.parametrize(
    ("behind_s", "then_behind_s"), [(OFFSET_S, 0), (0, OFFSET_S)], ids=["stepped-forward", "stepped-back"]
)
def test_a_clock_stepped_by_an_hour_declares_no_instance_dead_and_stops_no_batch(
    behind_s: int, then_behind_s: int, kafka_bootstrap: str, topic_prefix: str, tmp_path: Path
) -> None:
    """Injected: instance-1's host clock runs `behind_s` behind from its start; 20 s into the input (the
    controller's start grace long over), an NTP-like step sets it `then_behind_s` behind at once: an
    hour forward (a clock put right), or an hour back (a clock put wrong; Spark's trigger waits on the
    wall clock, so the instance restarts its query). A controller (static policy, heartbeat timeout
    10 s) runs throughout, and after the step moves a pid onto the skewed instance and one off it.

    Asserted: no process exits, the control log evicts no instance (nobody declared dead for its clock),
    both moves finish (the skewed instance runs batches after the step), the output is exact, and the
    fault took effect (the skewed instance's heartbeats carry times that far behind the other's)."""
    cfg = small_config(
        topic_prefix,
        "generator.mode=real_time",
        "generator.duration_s=50",
        "generator.rate={kind: constant, rate: 500}",
        "generator.keys={kind: uniform, count: 1000}",
        f"instances={len(INSTANCES)}",
    )
    offset_file = tmp_path / "skewed-host-clock"
    offset_file.write_text(f"{-behind_s}\n")
    pipeline = LocalPipeline(cfg, kafka_bootstrap, tmp_path / "work")
    watch = Watch(pipeline)
    try:
        pipeline.start_controller(policy="static", heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S)
        pipeline.start_instance("instance-0")
        pipeline.start_instance(SKEWED, env=_clock_env(offset_file, tmp_path))
        pipeline.wait_running(INSTANCES)
        start = watch.until(lambda v: bool(v.assignment and v.assignment.epoch == 0), 60, "epoch 0")
        assert start.assignment is not None
        generator = threading.Thread(target=run_generator, args=(cfg, kafka_bootstrap))
        generator.start()
        time.sleep(20)
        pipeline.check_alive()
        offset_file.write_text(f"{-then_behind_s}\n")  # the step
        time.sleep(10)
        owners = start.assignment.owners
        onto = next(p for p, o in sorted(owners.items()) if o != SKEWED)
        request_moves(cfg, kafka_bootstrap, [onto], SKEWED, Mode.TRANSFER)
        watch.until(moved([onto], SKEWED), 120, f"pid {onto} moved onto {SKEWED}")
        off = next(p for p, o in sorted(owners.items()) if o == SKEWED)
        request_moves(cfg, kafka_bootstrap, [off], "instance-0", Mode.TRANSFER)
        watch.until(moved([off], "instance-0"), 120, f"pid {off} moved off {SKEWED}")
        drained_and_nobody_evicted(pipeline, watch, generator)
    finally:
        watch.log.close()
        pipeline.stop()
    records = [json.loads(v) for _, _, v in read_topic(kafka_bootstrap, cfg.metrics_topic)]
    skews = _skews_s(records)
    assert skews and abs(skews[0] - behind_s) < 30, f"not {behind_s} s behind at first: {skews[:3]}"
    assert abs(skews[-1] - then_behind_s) < 30, f"not {then_behind_s} s behind at the end: {skews[-3:]}"
    report = verify_pipeline(pipeline.cfg, kafka_bootstrap)
    assert report.expected > 1_000, report.describe()
    assert report.exact, report.describe()
