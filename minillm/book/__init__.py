"""Code that only the book uses: checked claims and source excerpts for the chapters (``notebook``), figures
(``viz``), lab checkers and the grader (``labs``), instruments and quoted data. Nothing else in minillm
imports this package."""
