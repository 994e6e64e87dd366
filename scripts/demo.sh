#!/usr/bin/env bash
# One command from a fresh machine to a served, answering model:
# set up, build the archives into model_store/, start TorchServe from config/config.properties
# on 127.0.0.1, wait for /ping, classify a real photo over HTTP.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
TSV=.venv/bin/torchserve-vision
$TSV build
$TSV server start
PHOTOS=$(.venv/bin/python -c 'from torchserve_vision.photos import photo_path; print(photo_path().parent)')
echo
$TSV predict "$PHOTOS/chelsea.png" --model efficientnet_lite0
echo
echo "The detector below runs the real SSDlite320-MobileNetV3 architecture with fixed-seed weights"
echo "(no COCO weights can be installed here), so its boxes are not meaningful; see docs/requests.md to"
echo "build it from a real checkpoint."
$TSV predict "$PHOTOS/astronaut.png" --model ssdlite320 --max-detections 5
cat <<TEXT

TorchServe is running on 127.0.0.1 (inference :8080, management :8081, metrics :8082; logs in .run/logs).
Send your own image:
  curl -T my_photo.jpg http://127.0.0.1:8080/predictions/efficientnet_lite0
  curl -T my_photo.jpg -H 'X-Score-Threshold: 0.5' http://127.0.0.1:8080/predictions/ssdlite320
  .venv/bin/torchserve-vision predict my_photo.jpg [--model ssdlite320]
Stop the server:
  .venv/bin/torchserve-vision server stop
TEXT
