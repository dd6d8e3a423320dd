from vertumnus.cli import main

main()
