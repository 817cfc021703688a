from flashrl_tools.cli.app import main

main()
