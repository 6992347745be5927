"""Test support: what tests need to run the engine and compare runs, kept out of the product packages."""
