import os
import sys

# tests/models.py holds the small models shared by the backend tests.
sys.path.insert(0, os.path.dirname(__file__))
