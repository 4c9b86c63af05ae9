"""What the host keeps around decode programs: the compile cache, the program store, calibration
files on disk, the params caches, prompt preparation, output and streaming."""
