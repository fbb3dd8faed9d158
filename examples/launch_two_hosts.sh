#!/usr/bin/env bash
# Train examples/train_gpt.py on two hosts as one TofuStrategy run (docs/multi_host.md).
# Run on each host, the same HOSTS on both, CLIENT_ID 0 on the first and 1 on the second:
#   HOSTS=host0:9876,host1:9876 CLIENT_ID=0 bash examples/launch_two_hosts.sh --num_gpus=8
# To try it on one machine instead: tofu-launch --clients=2 -- python examples/train_gpt.py --num_gpus=4
set -euo pipefail
: "${HOSTS:?set HOSTS to host0:port,host1:port, the same on both hosts}"
: "${CLIENT_ID:?set CLIENT_ID to 0 on the first host and 1 on the second}"
cd "$(dirname "$0")/.."
DTENSOR_JOBS="$HOSTS" DTENSOR_CLIENT_ID="$CLIENT_ID" exec python examples/train_gpt.py "$@"
