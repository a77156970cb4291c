#!/bin/bash
# FlashAttention-4 (train.attention=fa4) for the lent H200, which has no flash-attn-4 and no internet. Run here, from
# the repository root, on a machine with the package registry: the wheels for Python 3.12 / CUDA 13 land in two
# ignored folders, .fa4a/ (54 MB) and .fa4b/ (44 MB), because one device call carries at most 64 MiB and the CuTe DSL
# library wheel alone is 92 MB. On the device, two calls back to back (the machine stays warm ~30 s between them):
#   call 1, carry [".fa4a"]:  mkdir -p /tmp/fa4 && cp .fa4a/* /tmp/fa4/            (+ anything that needs no FA4)
#   call 2, carry [".fa4b"]:  cp .fa4b/* /tmp/fa4/ && cat /tmp/fa4/cu13.part0[01] > /tmp/fa4/$CU13 &&
#     rm /tmp/fa4/cu13.part* && mkdir -p /tmp/site && for w in /tmp/fa4/*.whl; do python3 -m zipfile -e $w /tmp/site;
#     done && export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages && bash bench/run_speed.sh fa4
# (wheels unpacked, not pip-installed: `pip --target` replaces the shared nvidia_cutlass_dsl/ folder wheel by wheel,
# and ignores the .pth file that puts dsl_packages/ on the path.) On a normal machine: pip install '.[fa4]'.
set -eu
CU13=nvidia_cutlass_dsl_libs_cu13-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl
# .fa4a/ and .fa4b/ are in .gitignore: they travel only when a call names them in carry
mkdir -p .fa4a .fa4b /tmp/fa4-dl
python3 -m pip download -q --pre --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  -d /tmp/fa4-dl flash-attn-4==4.0.0b40 quack-kernels==0.6.5 apache-tvm-ffi==0.1.15.post2 torch-c-dlpack-ext==0.1.5 \
  nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 nvidia-cutlass-dsl-libs-core==4.8.1 \
  nvidia-cutlass-dsl-libs-cu13==4.8.1
find /tmp/fa4-dl -name '*.whl' ! -name "$CU13" -exec cp {} .fa4a/ \;
split -b 46000000 -d "/tmp/fa4-dl/$CU13" /tmp/fa4-dl/cu13.part
mv /tmp/fa4-dl/cu13.part00 .fa4a/ && mv /tmp/fa4-dl/cu13.part01 .fa4b/
du -sh .fa4a .fa4b
