"""A Python multiprocessing pool that forks continuously (one task per worker process), for CRIU tests.
Usage: forking_pool.py DIR; writes DIR/ready (its pid) and then DIR/count (tasks done) atomically."""
import multiprocessing
import os
import sys
import time

d = sys.argv[1]


def square(x: int) -> int:
    time.sleep(0.05)
    return x * x


def put(name: str, text: str) -> None:
    tmp = os.path.join(d, name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
    os.rename(tmp, os.path.join(d, name))


if __name__ == "__main__":
    multiprocessing.set_start_method("fork")
    done = 0
    with multiprocessing.Pool(2, maxtasksperchild=1) as pool:  # a fresh worker process for every task
        put("ready", str(os.getpid()))
        while True:
            done += len(pool.map(square, range(4), chunksize=1))
            put("count", str(done))
