import os
import sys
from pathlib import Path

# torchft's Rust logger reads RUST_LOG when it is first imported.
os.environ.setdefault("RUST_LOG", "warn")
sys.path.insert(0, str(Path(__file__).parent))
