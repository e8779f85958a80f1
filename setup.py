"""Installs the card's top-level folders under the one import name `pulseinfer` (pulseinfer.kernels,
pulseinfer.gpu_worker, ...): the distribution claims no generic top-level name. Metadata: pyproject.toml."""

from setuptools import find_packages, setup

FOLDERS = ("proto", "kernels", "kv_store", "scheduler", "gpu_worker", "gateway", "bench")

packages = find_packages(include=["pulseinfer", "pulseinfer.*"])
package_dir = {"pulseinfer": "pulseinfer"}
for folder in FOLDERS:
    package_dir[f"pulseinfer.{folder}"] = folder
    packages += [f"pulseinfer.{name}" for name in find_packages(include=[folder, f"{folder}.*"])]

DATA = {
    "pulseinfer.common.model": ["geometries/*/config.json"],  # the --load-format dummy geometries
    "pulseinfer.bench": ["traces/*"],  # the Mooncake trace the benchmarks replay
}
setup(packages=packages, package_dir=package_dir, package_data=DATA)
