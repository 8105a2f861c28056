from dsocr_workers.cli import main

main()
