#!/usr/bin/env bash
# One command from a fresh machine to a served, answering model:
# set up, build the archives into model_store/, start TorchServe from config/config.properties
# on 127.0.0.1, wait for /ping, classify a real photo and detect what is in two others over HTTP
# (the astronaut's boxes drawn into .run/astronaut-detections.png).
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
$TSV predict "$PHOTOS/astronaut.png" --model ssd_mobilenet_v2 --draw .run/astronaut-detections.png
echo
$TSV predict "$PHOTOS/coffee.png" --model ssd_mobilenet_v2
cat <<TEXT

TorchServe is running on 127.0.0.1 (inference :8080, management :8081, metrics :8082; logs in .run/logs).
Send your own image:
  curl -T my_photo.jpg http://127.0.0.1:8080/predictions/efficientnet_lite0
  curl -T my_photo.jpg -H 'X-Score-Threshold: 0.5' http://127.0.0.1:8080/predictions/ssd_mobilenet_v2
  .venv/bin/torchserve-vision predict my_photo.jpg --model ssd_mobilenet_v2 --draw boxes.png
  .venv/bin/torchserve-vision predict my_photos/ --model ssd_mobilenet_v2 --out answers.jsonl --draw drawn/
Stop the server:
  .venv/bin/torchserve-vision server stop
TEXT
