"""Run with DEVSHIM_AUTO=1: spawn and forkserver children report whether devshim is active in them."""

import multiprocessing as mp


def child(queue):  # runs in a fresh interpreter that never imports devshim itself
    import sys

    from deepspeed.accelerator import get_accelerator
    queue.put(("devshim_core.session" in sys.modules, type(get_accelerator()).__name__))


if __name__ == "__main__":
    for method in ("spawn", "forkserver"):
        context = mp.get_context(method)
        queue = context.Queue()
        worker = context.Process(target=child, args=(queue,))
        worker.start()
        print(method, *queue.get(timeout=120))
        worker.join()
