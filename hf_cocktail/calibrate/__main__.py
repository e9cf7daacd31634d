import sys

from hf_cocktail.calibrate.cli import main

sys.exit(main())
