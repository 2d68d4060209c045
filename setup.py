"""Maps the repository's top-level folders to their hisparse_-prefixed import names.

The tree keeps backends and plugins in descriptive folders (backends/nvidia, plugins/vllm);
installed, they are hisparse_nvidia, hisparse_vllm, ... and nothing installs a top-level
`backends` or `plugins` package. Everything else lives in pyproject.toml.
"""

from setuptools import find_packages, setup

ROOTS = {
    "hisparse_core": "hisparse_core",
    "hisparse_reference_cpu": "backends/reference_cpu",
    "hisparse_nvidia": "backends/nvidia",
    "hisparse_conformance": "plugins/conformance",
    "hisparse_vllm": "plugins/vllm",
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
