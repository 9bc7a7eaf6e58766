import sys
import edge_sdk.mapped_pages as mp
mp.release_checkpoint_pages = lambda maps: 0
from specrelay_cli import main as cli
sys.argv = ["specrelay", "demo", "Write a Python function that checks whether a number is prime."]
cli()
