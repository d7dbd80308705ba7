"""mnv3: MobileNetV3 (Large or Small, ImageNet or your own fine-tune) made fast on CPUs and served over HTTP."""
