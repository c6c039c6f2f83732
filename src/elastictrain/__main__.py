from elastictrain.cli import main

main()
