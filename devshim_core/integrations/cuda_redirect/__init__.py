"""The CUDA redirect: ``torch.cuda.*``, ``'cuda'`` devices, CUDA type names, CUDA autocast and the ``nccl``
backend, answered by the selected device. On when the selected device is not CUDA; ``DEVSHIM_REDIRECT_CUDA=0``
turns it off. What it covers is data (``coverage``); how, one declared patch set (``patches``)."""
