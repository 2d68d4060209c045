"""Collects the packages of the repository's folders into one distribution.

Each backend and plugin keeps its package in a descriptive folder (backends/nvidia/hisparse_nvidia,
plugins/vllm/hisparse_vllm, ...). The folder holding a package is its import root, so the folder
name and the import name agree in every context (installed, editable, pytest's rootdir-based
imports), and nothing installs a top-level `backends` or `plugins` package. Everything else lives
in pyproject.toml.
"""

from setuptools import find_packages, setup

ROOTS = {
    "hisparse_core": "hisparse_core",
    "hisparse_reference_cpu": "backends/reference_cpu/hisparse_reference_cpu",
    "hisparse_nvidia": "backends/nvidia/hisparse_nvidia",
    "hisparse_triton": "backends/triton/hisparse_triton",
    "hisparse_conformance": "plugins/conformance/hisparse_conformance",
    "hisparse_vllm": "plugins/vllm/hisparse_vllm",
    "hisparse_transformers": "plugins/transformers/hisparse_transformers",
}

packages: list[str] = []
package_dir: dict[str, str] = {}
for name, path in ROOTS.items():
    packages.append(name)
    package_dir[name] = path
    for sub in find_packages(path):
        packages.append(f"{name}.{sub}")
        package_dir[f"{name}.{sub}"] = f"{path}/{sub.replace('.', '/')}"

setup(packages=packages, package_dir=package_dir)
