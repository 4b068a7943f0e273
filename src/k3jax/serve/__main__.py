from k3jax.serve.main import main

raise SystemExit(main())
