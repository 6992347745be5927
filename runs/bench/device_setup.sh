# Sourced by runs/bench's device scripts once they have cd'd to the repository root and set OUT: NCCL without NVLink
# multicast (the device docs ask it), the wheels carried in .whl installed into /tmp/site and put first on
# PYTHONPATH, and $OUT/device.txt naming the GPU, its driver, torch and the host's CPU. (No git revision: the device's
# copy of the checkout can carry a stale one; the commit goes into BENCHMARKS.md instead.)
mkdir -p "$OUT" runs/out
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python3 -c "import torch; print(torch.__version__)"
  lscpu | grep -E "Model name|^CPU\(s\)"; } > "$OUT/device.txt"
