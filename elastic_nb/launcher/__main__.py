from elastic_nb.launcher.agent import main

if __name__ == "__main__":
    main()
