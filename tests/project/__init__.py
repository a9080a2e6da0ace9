"""The test project: settings, URLconfs and views the tests drive (no tests here)."""
