import sys
from pathlib import Path

# test-support modules of this package (pytest runs in importlib mode): fake_engine
sys.path.insert(0, str(Path(__file__).parent))
